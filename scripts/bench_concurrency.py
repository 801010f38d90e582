"""Concurrent sessions through the SDK: aggregate throughput and inter-token latency against the number of sessions,
with batched decoding, with --max-batch-size 1, and each session alone, side by side in one run.

Two `kakeya-runtime serve` daemons run side by side on loopback ports (`--max-concurrent` = the largest session
count; `--max-batch-size` = `--batch-size` for the batched mode, 1 for the other; every other flag the daemon's
default). Each session has its own prompt: `--prompt-tokens` random tokens, or, with `--history-tokens MIN MAX`,
a history of held-out standard-library source whose length is spread from MIN to MAX over the sessions (shuffled
by `--seed`, so any first N are mixed). Every daemon prefills each session once (one generated token); a round then
forks the sessions it needs (the forks' caches are copies, so no round pays a prefill) and times their generation.

For each session count N, the N sessions generate `--max-tokens` greedy tokens (no EOS stops them) through the
asyncio Python SDK: at once in the batched and unbatched modes, and one after another on the batched daemon in
the alone mode (its throughput is all sessions' tokens over the sum of their walls: what one session at a time
gives). `--rounds` rounds per mode, the modes' rounds interleaved so all meet the same load on a shared machine;
the median round (by throughput) is reported. Recorded per configuration: wall time from the first request to the
last token, aggregate tokens/s, p50/p99 of the gaps between consecutive tokens of a session (all sessions' gaps
together), the forwards the daemon ran for the round and their mean rows (from its /metrics, on a loopback port),
with the seconds its steps waited to join one, and the 1-minute load average before and after. Every session's
tokens in the batched mode are compared with the same session's in the other two modes (greedy: they must be
equal). `--proposer` sets both daemons' speculative proposer (dflash: the model's own drafter unless
`--draft-model` names one); the batched daemon then also drafts the sessions of a step together where the proposer
can (dflash: one drafter forward per step). Daemon settings the bench does not pass go by environment
(`KAKEYA_BATCH_WAIT_MS=0 python scripts/bench_concurrency.py ...`) and are recorded with the results.

The summary gives, per mode, throughput at N over throughput at the first session count ("scaling"), and batched
throughput over unbatched and over alone at each N.

Bounded: N x `--max-tokens` tokens per configuration, and `--time-limit-s` per configuration; loopback only.

Usage:
    python scripts/bench_concurrency.py [--model NAME|DIR|GGUF] [--sessions 1 2 4 8 16] [--max-tokens 64]
        [--prompt-tokens 32 | --history-tokens MIN MAX] [--batch-size 16] [--rounds 3] [--threads 0]
        [--backend torch] [--proposer ngram] [--draft-model DIR] [--time-limit-s 300] [--results-dir DIR]
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
from lib.decode_arms import history_tokens
from lib.model_option import add_model_option
from lib.results import RESULTS_DIR, write_results

from inference_engine.config import ServerConfig
from inference_engine.model_dir_info import model_drafter

MODES = ("batched", "unbatched", "alone")
DAEMONS = ("batched", "unbatched")  # the alone mode runs on the batched daemon


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(p, "the model both daemons serve")
    p.add_argument(
        "--sessions", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="session counts (default: 1 2 4 8 16)"
    )
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens each session generates (default: 64)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="random prompt of each session (default: 32)")
    p.add_argument(
        "--history-tokens",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=None,
        help="instead of random prompts: held-out source histories of MIN to MAX tokens, spread over the sessions",
    )
    p.add_argument("--batch-size", type=int, default=16, help="--max-batch-size of the batched mode (default: 16)")
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds per mode and session count; the median is kept (default: 3)"
    )
    p.add_argument("--threads", type=int, default=0, help="--threads of both daemons (default: 0, one per usable core)")
    p.add_argument("--backend", default="torch", choices=("torch", "mlx"), help="daemon backend (default: torch)")
    daemon_proposer = ServerConfig().proposer
    p.add_argument(
        "--proposer",
        default=daemon_proposer,
        choices=("none", "ngram", "dflash"),
        help=f"speculative proposer of both daemons (default: {daemon_proposer}, the daemon's own default)",
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
    if args.history_tokens is not None and not 1 <= args.history_tokens[0] <= args.history_tokens[1]:
        p.error("--history-tokens MIN MAX needs 1 <= MIN <= MAX")
    if args.proposer == "dflash" and args.draft_model is None and model_drafter(args.model) is None:
        p.error(f"--proposer dflash: {args.model_name} ships no DFlash drafter (dflash/); name one with --draft-model")
    return args


FORWARD_METRICS = ("kakeya_batch_size_sum", "kakeya_batch_size_count", "kakeya_batch_queue_wait_seconds_sum")


def _forward_counters(daemon: Daemon) -> dict[str, float]:
    """The daemon's totals of rows per forward and of the time steps waited for one (FORWARD_METRICS)."""
    samples = daemon.metrics()
    return {name: samples.get(name, 0.0) for name in FORWARD_METRICS}


def _forwards(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """A round's forwards, their mean rows, and the seconds its steps waited to join one (summed over steps)."""
    forwards = after["kakeya_batch_size_count"] - before["kakeya_batch_size_count"]
    rows = after["kakeya_batch_size_sum"] - before["kakeya_batch_size_sum"]
    waited = after["kakeya_batch_queue_wait_seconds_sum"] - before["kakeya_batch_queue_wait_seconds_sum"]
    return {"forwards": forwards, "mean_rows": rows / forwards if forwards else 0.0, "step_wait_s": waited}


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _load() -> float:
    return os.getloadavg()[0]


async def _prefilled(client: kakeya.AsyncClient, prompts: list[list[int]]) -> list[Any]:
    """One session per prompt, each prefilled by generating one token (no EOS stops a session's generation)."""
    sessions = []
    for prompt in prompts:
        session = await client.create_session(initial_tokens=prompt, eos_token_ids=[])
        async for _ in session.generate(1):
            pass
        sessions.append(session)
    return sessions


async def _timed(session: Any, max_tokens: int, gaps: list[float]) -> list[int]:
    tokens: list[int] = []
    last: float | None = None
    async for token in session.generate(max_tokens):
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
        tokens.append(token)
    return tokens


async def _round(held: list[Any], max_tokens: int, *, together: bool) -> dict[str, Any]:
    """Forks of the held sessions generate, at once (`together`) or one after another; returns their tokens,
    token arrival gaps and the wall time (alone: the sum of each generation's)."""
    forks = [await session.fork() for session in held]
    gaps: list[float] = []
    try:
        if together:
            started = time.perf_counter()
            tokens = list(await asyncio.gather(*(_timed(f, max_tokens, gaps) for f in forks)))
            wall_s = time.perf_counter() - started
        else:
            tokens, wall_s = [], 0.0
            for fork in forks:
                started = time.perf_counter()
                tokens.append(await _timed(fork, max_tokens, gaps))
                wall_s += time.perf_counter() - started
    finally:
        for fork in forks:
            await fork.close()
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
        **chosen["forwards"],
        "session_tokens": chosen["tokens"],
        "gaps_s": chosen["gaps_s"],
    }


async def _drive(
    addresses: dict[str, str], daemons: dict[str, Daemon], args: argparse.Namespace, prompts: list[list[int]]
) -> dict[str, list[dict[str, Any]]]:
    """Every session count, each mode's rounds interleaved (batched, unbatched, alone, batched, ...) so that all
    modes meet the same load on a shared machine."""
    out: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    clients = {name: kakeya.AsyncClient(address, timeout_s=args.time_limit_s) for name, address in addresses.items()}
    try:
        held: dict[str, list[Any]] = {}
        for name, client in clients.items():
            await client.wait_until_ready(60)
            held[name] = await _prefilled(client, prompts)
            await _round(held[name][:2], 8, together=True)  # warm-up: first forwards allocate and compile
        for count in args.sessions:
            rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
            loads: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
            for _ in range(args.rounds):
                for mode in MODES:
                    daemon = "batched" if mode == "alone" else mode
                    before, counters = _load(), _forward_counters(daemons[daemon])
                    result = await asyncio.wait_for(
                        _round(held[daemon][:count], args.max_tokens, together=mode != "alone"), args.time_limit_s
                    )
                    result["forwards"] = _forwards(counters, _forward_counters(daemons[daemon]))
                    rounds[mode].append(result)
                    loads[mode].append((before, _load()))
            for mode in MODES:
                out[mode].append(_configuration(count, rounds[mode], loads[mode]))
                print(
                    f"  {mode:>9} {count:>3} sessions: {out[mode][-1]['aggregate_tokens_per_s']:.1f} tokens/s, "
                    f"p50 gap {1000 * out[mode][-1]['inter_token_p50_s']:.1f} ms, "
                    f"{out[mode][-1]['mean_rows']:.2f} rows per forward",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for client in clients.values():
            await client.close()
    return out


def session_prompts(args: argparse.Namespace) -> list[list[int]]:
    """Each session's prompt: random tokens, or held-out histories of lengths spread over `--history-tokens`."""
    count = max(max(args.sessions), 2)
    rng = random.Random(args.seed)
    if args.history_tokens is None:
        from transformers import AutoConfig

        vocab = int(AutoConfig.from_pretrained(args.model, local_files_only=True).vocab_size)
        return [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(count)]
    low, high = args.history_tokens
    lengths = [round(low + (high - low) * i / max(1, count - 1)) for i in range(count)]
    rng.shuffle(lengths)
    text = history_tokens(args.model, sum(lengths))
    starts = [sum(lengths[:i]) for i in range(count)]
    return [text[start : start + length] for start, length in zip(starts, lengths, strict=True)]


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
        "--metrics-port",
        "0",
    ]
    if args.draft_model is not None:
        flags += ["--draft-model", str(args.draft_model)]
    return Daemon(flags)


def _plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for (mode, rows), color in zip(runs.items(), ("tab:blue", "tab:orange", "tab:green"), strict=False):
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
    prompts = session_prompts(args)
    daemons = {name: start_daemon(args, name) for name in DAEMONS}
    try:
        addresses = {name: daemon.wait_listening() for name, daemon in daemons.items()}
        runs = asyncio.run(_drive(addresses, daemons, args, prompts))
    finally:
        for daemon in daemons.values():
            daemon.stop()

    def table(mode: str) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k not in ("session_tokens", "gaps_s")} for r in runs[mode]]

    def scaling(mode: str) -> dict[str, float]:
        base = runs[mode][0]["aggregate_tokens_per_s"]
        return {str(r["sessions"]): r["aggregate_tokens_per_s"] / base for r in runs[mode]}

    def mismatches(other: str) -> int:
        return sum(
            a != b
            for batched, rows in zip(runs["batched"], runs[other], strict=True)
            for a, b in zip(batched["session_tokens"], rows["session_tokens"], strict=True)
        )

    def over(other: str) -> dict[str, float]:
        return {
            str(b["sessions"]): b["aggregate_tokens_per_s"] / o["aggregate_tokens_per_s"]
            for b, o in zip(runs["batched"], runs[other], strict=True)
        }

    summary: dict[str, Any] = {
        mode: {"configurations": table(mode), "scaling_vs_first": scaling(mode)} for mode in MODES
    }
    summary["batched_over_unbatched"] = over("unbatched")
    summary["batched_over_alone"] = over("alone")
    summary["session_token_mismatches"] = mismatches("unbatched")
    summary["session_token_mismatches_vs_alone"] = mismatches("alone")
    summary["history_lengths"] = [len(p) for p in prompts]
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
