"""Concurrent sessions through the SDK: aggregate throughput and inter-token latency against the number of sessions,
with batched decoding and with --max-batch-size 1, side by side in one run.

Two `kakeya-runtime serve` daemons run side by side on loopback ports (`--max-concurrent` = the largest session
count; `--max-batch-size` = `--batch-size` for the batched mode, 1 for the other). For each session count N, N
sessions, each with its own random prompt of `--prompt-tokens`, generate `--max-tokens` greedy tokens at once
through the asyncio Python SDK; `--rounds` rounds per mode, the modes' rounds interleaved so both meet the same load
on a shared machine, and the median round (by throughput) is reported. Recorded per configuration: wall time from
the first request to the last token, aggregate tokens/s (all sessions' tokens over that wall time), p50/p99 of the
gaps between consecutive tokens of a session (all sessions' gaps together), and the 1-minute load average before
and after. Every session's tokens in the batched mode are compared with the same session's in the unbatched mode
(greedy: they must be equal). `--proposer` sets both daemons' speculative proposer (dflash: the model's own drafter
unless `--draft-model` names one); the batched daemon then also drafts the sessions of a step together where the
proposer can (dflash: one drafter forward per step).

The summary gives, per mode, throughput at N over throughput at 1 session ("scaling"), and batched over unbatched
throughput at each N.

Bounded: N x `--max-tokens` tokens per configuration, and `--time-limit-s` per configuration; loopback only.

Usage:
    python scripts/bench_concurrency.py [--model NAME|DIR|GGUF] [--sessions 1 2 4 8 16] [--max-tokens 64]
        [--prompt-tokens 32] [--batch-size 16] [--rounds 3] [--threads 0] [--backend torch]
        [--proposer none] [--draft-model DIR] [--time-limit-s 300] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kakeya
from lib.daemon import Daemon
from lib.model_option import add_model_option
from lib.results import RESULTS_DIR, write_results

from inference_engine.config import model_drafter

MODES = ("batched", "unbatched")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(p, "the model both daemons serve")
    p.add_argument(
        "--sessions", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="session counts (default: 1 2 4 8 16)"
    )
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens each session generates (default: 64)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="random prompt of each session (default: 32)")
    p.add_argument("--batch-size", type=int, default=16, help="--max-batch-size of the batched mode (default: 16)")
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds per mode and session count; the median is kept (default: 3)"
    )
    p.add_argument("--threads", type=int, default=0, help="--threads of both daemons (default: 0, one per usable core)")
    p.add_argument("--backend", default="torch", choices=("torch", "mlx"), help="daemon backend (default: torch)")
    p.add_argument(
        "--proposer",
        default="none",
        choices=("none", "ngram", "dflash"),
        help="speculative proposer of both daemons (default: none)",
    )
    p.add_argument(
        "--draft-model",
        type=Path,
        default=None,
        help="dflash: the drafter directory (default: none given, the daemon uses the model's dflash/ subdirectory)",
    )
    p.add_argument(
        "--time-limit-s", type=float, default=300.0, help="per configuration: give up after this (default: 300)"
    )
    p.add_argument("--seed", type=int, default=0, help="random prompts (default: 0)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON and PNG go")
    args = p.parse_args(argv)
    if args.proposer == "dflash" and args.draft_model is None and model_drafter(args.model) is None:
        p.error(f"--proposer dflash: {args.model_name} ships no DFlash drafter (dflash/); name one with --draft-model")
    return args


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _load() -> float:
    return os.getloadavg()[0]


async def _round(client: kakeya.AsyncClient, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """All sessions generate at once; returns their tokens, token arrival gaps and the wall time."""
    sessions = [await client.create_session(initial_tokens=p) for p in prompts]
    gaps: list[float] = []

    async def run(session: Any) -> list[int]:
        tokens: list[int] = []
        last: float | None = None
        async for token in session.generate(max_tokens):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            tokens.append(token)
        return tokens

    started = time.perf_counter()
    tokens = await asyncio.gather(*(run(s) for s in sessions))
    wall_s = time.perf_counter() - started
    for session in sessions:
        await session.close()
    return {"tokens": tokens, "gaps_s": gaps, "wall_s": wall_s}


def _configuration(count: int, rounds: list[dict[str, Any]], loads: list[tuple[float, float]]) -> dict[str, Any]:
    """One mode at one session count: the median round by throughput, with every round's throughput."""
    rates = [sum(len(t) for t in r["tokens"]) / r["wall_s"] for r in rounds]
    median = sorted(range(len(rounds)), key=lambda i: rates[i])[len(rounds) // 2]
    chosen = rounds[median]
    return {
        "sessions": count,
        "tokens": sum(len(t) for t in chosen["tokens"]),
        "wall_s": chosen["wall_s"],
        "aggregate_tokens_per_s": rates[median],
        "aggregate_tokens_per_s_rounds": rates,
        "inter_token_p50_s": _percentile(chosen["gaps_s"], 0.5),
        "inter_token_p99_s": _percentile(chosen["gaps_s"], 0.99),
        "load_1m_before": loads[median][0],
        "load_1m_after": loads[median][1],
        "session_tokens": chosen["tokens"],
        "gaps_s": chosen["gaps_s"],
    }


async def _drive(
    addresses: dict[str, str], args: argparse.Namespace, prompts: list[list[int]]
) -> dict[str, list[dict[str, Any]]]:
    """Every session count, each mode's rounds interleaved (batched, unbatched, batched, ...) so that both modes
    meet the same load on a shared machine."""
    out: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    clients = {mode: kakeya.AsyncClient(address, timeout_s=args.time_limit_s) for mode, address in addresses.items()}
    try:
        for client in clients.values():
            await client.wait_until_ready(60)
            await _round(client, prompts[:2], 8)  # warm-up: first forwards allocate and compile
        for count in args.sessions:
            rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
            loads: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
            for _ in range(args.rounds):
                for mode in MODES:
                    before = _load()
                    result = await asyncio.wait_for(
                        _round(clients[mode], prompts[:count], args.max_tokens), args.time_limit_s
                    )
                    rounds[mode].append(result)
                    loads[mode].append((before, _load()))
            for mode in MODES:
                out[mode].append(_configuration(count, rounds[mode], loads[mode]))
                print(
                    f"  {mode:>9} {count:>3} sessions: {out[mode][-1]['aggregate_tokens_per_s']:.1f} tokens/s, "
                    f"p50 gap {1000 * out[mode][-1]['inter_token_p50_s']:.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for client in clients.values():
            await client.close()
    return out


def start_daemon(args: argparse.Namespace, mode: str) -> Daemon:
    batch = args.batch_size if mode == "batched" else 1
    flags = [
        "--model",
        str(args.model),
        "--backend",
        args.backend,
        "--max-concurrent",
        str(max(args.sessions)),
        "--max-batch-size",
        str(batch),
        "--max-sessions",
        str(max(64, max(args.sessions) + 2)),
        "--queue-deadline-s",
        str(args.time_limit_s),
        "--threads",
        str(args.threads),
        "--proposer",
        args.proposer,
    ]
    if args.draft_model is not None:
        flags += ["--draft-model", str(args.draft_model)]
    return Daemon(flags)


def _plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for (mode, rows), color in zip(runs.items(), ("tab:blue", "tab:orange"), strict=False):
        counts = [r["sessions"] for r in rows]
        left.plot(counts, [r["aggregate_tokens_per_s"] for r in rows], marker="o", color=color, label=mode)
        p50 = [1000 * r["inter_token_p50_s"] for r in rows]
        p99 = [1000 * r["inter_token_p99_s"] for r in rows]
        right.plot(counts, p50, marker="o", color=color, label=f"{mode} p50")
        right.plot(counts, p99, marker="x", ls="--", color=color, label=f"{mode} p99")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sessions")
        ax.legend()
    left.set_ylabel("aggregate tokens/s")
    left.set_title("Throughput")
    right.set_ylabel("inter-token latency (ms)")
    right.set_title("Inter-token latency")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(args.model, local_files_only=True).vocab_size)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(max(max(args.sessions), 2))]
    daemons = {mode: start_daemon(args, mode) for mode in MODES}
    try:
        addresses = {mode: daemon.wait_listening() for mode, daemon in daemons.items()}
        runs = asyncio.run(_drive(addresses, args, prompts))
    finally:
        for daemon in daemons.values():
            daemon.stop()

    def table(mode: str) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k not in ("session_tokens", "gaps_s")} for r in runs[mode]]

    def scaling(mode: str) -> dict[str, float]:
        base = runs[mode][0]["aggregate_tokens_per_s"]
        return {str(r["sessions"]): r["aggregate_tokens_per_s"] / base for r in runs[mode]}

    mismatches = sum(
        a != b
        for batched, unbatched in zip(runs["batched"], runs["unbatched"], strict=True)
        for a, b in zip(batched["session_tokens"], unbatched["session_tokens"], strict=True)
    )
    summary: dict[str, Any] = {
        mode: {"configurations": table(mode), "scaling_vs_first": scaling(mode)} for mode in MODES
    }
    summary["batched_over_unbatched"] = {
        str(b["sessions"]): b["aggregate_tokens_per_s"] / u["aggregate_tokens_per_s"]
        for b, u in zip(runs["batched"], runs["unbatched"], strict=True)
    }
    summary["session_token_mismatches"] = mismatches
    summary["first_session_count"] = args.sessions[0]
    path = write_results(
        "bench_concurrency",
        config=dict(vars(args)),
        samples={
            mode: [{"sessions": r["sessions"], "gaps_s": r["gaps_s"]} for r in rows] for mode, rows in runs.items()
        },
        summary=summary,
        plot=lambda png: _plot(runs, png),
        out_dir=args.results_dir,
        environment_extra={"load_1m_at_end": _load()},
    )
    print(path)
    return path


if __name__ == "__main__":
    main()
