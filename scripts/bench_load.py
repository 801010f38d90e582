"""Load on one daemon: many sessions taking turns at once, at several --max-concurrent settings, with and without
the session journal (--state-dir), side by side in one run.

Every configuration starts its own `kakeya-runtime serve` on a loopback port and drives it with the asyncio Python
SDK: `--sessions` sessions, each starting from its own random prompt, take `--turns` turns at once (append
`--append-tokens` tokens, generate `--max-tokens` greedy tokens). Every turn's latency (append + generation) is
recorded. At the end each session's server history is compared with the client's own record (a mismatch is a lost,
duplicated or reordered token), the sessions are closed, and the daemon's KV gauge must be back at zero. The
summary gives p50/p99 turn latency per configuration, errors, mismatches, and the journal's cost: the ratio of p50
turn latency with --state-dir to without, at each --max-concurrent. It also times the journal alone, in process:
how long queueing one write holds the event loop, and how long a write takes to commit, under each sync policy.

Bounded: `--time-limit-s` per configuration stops new turns (the summary says how many ran); loopback only.

Usage:
    python scripts/bench_load.py [--model NAME|DIR|GGUF] [--sessions 64] [--turns 50] [--append-tokens 8]
        [--max-tokens 4] [--max-concurrent 1 4] [--journal-sync normal] [--journal-writes 1000] [--time-limit-s 600]
        [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kakeya
from lib.daemon import Daemon
from lib.model_option import add_model_option
from lib.results import RESULTS_DIR, write_results

from inference_engine.journal import Journal, JournalAppended, JournalOpened, SessionHeader
from inference_engine.journal.sqlite import SqliteJournal

_METRICS_PORT = re.compile(r'"msg": "listening".*"metrics_url": "http://[^"]*:(\d+)/metrics"')
_KV_GAUGE = re.compile(r"^kakeya_session_kv_live_bytes (\S+)$", re.MULTILINE)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(p, "the model the daemons serve")
    p.add_argument("--sessions", type=int, default=64, help="sessions taking turns at once (default: 64)")
    p.add_argument("--turns", type=int, default=50, help="turns per session (default: 50)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="initial history of each session (default: 32)")
    p.add_argument("--append-tokens", type=int, default=8, help="tokens appended per turn (default: 8)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens generated per turn (default: 4)")
    p.add_argument(
        "--max-concurrent", type=int, nargs="+", default=[1, 4], help="--max-concurrent values (default: 1 4)"
    )
    p.add_argument(
        "--journal-sync", default="normal", choices=("normal", "full"), help="journal sync policy (default: normal)"
    )
    p.add_argument(
        "--time-limit-s", type=float, default=600.0, help="per configuration: no new turn after this (default: 600)"
    )
    p.add_argument(
        "--journal-writes", type=int, default=1000, help="writes timed per sync policy in process (default: 1000)"
    )
    p.add_argument("--seed", type=int, default=0, help="random prompts and appended tokens (default: 0)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON and PNG go")
    return p.parse_args(argv)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _kv_live_bytes(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        match = _KV_GAUGE.search(reply.read().decode())
    if match is None:
        raise RuntimeError("the daemon's /metrics has no kakeya_session_kv_live_bytes gauge")
    return float(match.group(1))


async def _drive(address: str, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Run every session's turns at once; returns latencies, errors, mismatches and turn counts."""
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.sessions)]
    appends = [
        [[rng.randrange(vocab) for _ in range(args.append_tokens)] for _ in range(args.turns)]
        for _ in range(args.sessions)
    ]
    latencies: list[float] = []
    errors: list[str] = []
    deadline = time.monotonic() + args.time_limit_s
    mismatches = 0
    async with kakeya.AsyncClient(address, timeout_s=600) as client:
        await client.wait_until_ready(30)
        sessions = [await client.create_session(initial_tokens=p) for p in prompts]

        async def run(index: int) -> list[int]:
            session = sessions[index]
            history = list(prompts[index])
            for turn in range(args.turns):
                if time.monotonic() > deadline:
                    break
                started = time.perf_counter()
                try:
                    await session.append(appends[index][turn])
                    history += appends[index][turn]
                    history += [token async for token in session.generate(args.max_tokens)]
                except kakeya.KakeyaError as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                    break
                latencies.append(time.perf_counter() - started)
            return history

        histories = await asyncio.gather(*(run(i) for i in range(args.sessions)))
        for session, history in zip(sessions, histories, strict=True):
            info = await session.info(history_tail_tokens=len(history))
            if info.history_length != len(history) or list(info.history_tail) != history:
                mismatches += 1
        for session in sessions:
            await session.close()
    return {"latencies_s": latencies, "errors": errors, "mismatches": mismatches}


def measure_journal(sync: str, writes: int) -> dict[str, Any]:
    """Time `writes` sequential appends of 4 tokens through the journal's writer thread, from an event loop."""
    with tempfile.TemporaryDirectory(prefix="kakeya-bench-journal-") as directory:
        backend = SqliteJournal(Path(directory), sync=sync)
        backend.load({"model": "bench"})
        journal = Journal(backend)
        header = SessionHeader("bench", "", (), "full", 0, 0)
        submit_s: list[float] = []
        commit_s: list[float] = []

        async def run() -> None:
            await journal.write(JournalOpened(header, tuple(range(32)), time.time()))
            for i in range(writes):
                started = time.perf_counter()
                done = journal.submit(JournalAppended("bench", (i, i + 1, i + 2, i + 3), time.time()))
                queued = time.perf_counter()
                await asyncio.wrap_future(done)
                submit_s.append(queued - started)
                commit_s.append(time.perf_counter() - started)

        asyncio.run(run())
        journal.close()
    return {
        "sync": sync,
        "writes": writes,
        "event_loop_hold_p50_s": _percentile(submit_s, 0.5),
        "event_loop_hold_max_s": max(submit_s),
        "commit_p50_s": _percentile(commit_s, 0.5),
        "commit_p99_s": _percentile(commit_s, 0.99),
    }


def run_configuration(args: argparse.Namespace, max_concurrent: int, journal: bool, vocab: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kakeya-bench-load-") as state_dir:
        flags = [
            "--model",
            str(args.model),
            "--metrics-port",
            "0",
            "--max-concurrent",
            str(max_concurrent),
            "--max-sessions",
            str(max(64, args.sessions)),
            "--queue-deadline-s",
            "600",
        ]
        if journal:
            flags += ["--state-dir", state_dir, "--journal-sync", args.journal_sync]
        daemon = Daemon(flags)
        try:
            address = daemon.wait_listening()
            port = next(int(m.group(1)) for line in daemon.lines if (m := _METRICS_PORT.search(line)))
            started = time.perf_counter()
            outcome = asyncio.run(_drive(address, args, vocab))
            wall_s = time.perf_counter() - started
            kv_after_close = _kv_live_bytes(port)
        finally:
            daemon.stop()
    latencies = outcome["latencies_s"]
    return {
        "max_concurrent": max_concurrent,
        "journal": journal,
        "turns": len(latencies),
        "wall_s": wall_s,
        "turn_latency_p50_s": _percentile(latencies, 0.5),
        "turn_latency_p99_s": _percentile(latencies, 0.99),
        "turn_latency_mean_s": statistics.fmean(latencies) if latencies else float("nan"),
        "errors": len(outcome["errors"]),
        "error_examples": outcome["errors"][:5],
        "history_mismatches": outcome["mismatches"],
        "kv_live_bytes_after_close": kv_after_close,
        "latencies_s": latencies,
    }


def _plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"mc={r['max_concurrent']}\n{'journal' if r['journal'] else 'memory'}" for r in runs]
    data = [[1000 * x for x in r["latencies_s"]] or [0.0] for r in runs]
    ax.boxplot(data, whis=(1, 99), showfliers=False)
    ax.set_xticks(range(1, len(runs) + 1), labels)
    ax.set_ylabel("turn latency (ms), whiskers p1-p99")
    ax.set_title("Turn latency under load, with and without --state-dir")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(args.model, local_files_only=True).vocab_size)
    journal_alone = [measure_journal(sync, args.journal_writes) for sync in ("normal", "full")]
    runs = []
    for max_concurrent in args.max_concurrent:
        for journal in (False, True):
            print(f"max_concurrent={max_concurrent} journal={journal} ...", file=sys.stderr, flush=True)
            runs.append(run_configuration(args, max_concurrent, journal, vocab))
    summary: dict[str, Any] = {
        "configurations": [{k: v for k, v in r.items() if k != "latencies_s"} for r in runs],
        "total_errors": sum(r["errors"] for r in runs),
        "total_history_mismatches": sum(r["history_mismatches"] for r in runs),
        "kv_live_bytes_after_close_max": max(r["kv_live_bytes_after_close"] for r in runs),
        "journal_p50_latency_ratio": {},
        "journal_alone": journal_alone,
    }
    for max_concurrent in args.max_concurrent:
        memory, journaled = (
            next(r for r in runs if r["max_concurrent"] == max_concurrent and r["journal"] is j) for j in (False, True)
        )
        summary["journal_p50_latency_ratio"][str(max_concurrent)] = (
            journaled["turn_latency_p50_s"] / memory["turn_latency_p50_s"]
        )
    path = write_results(
        "bench_load",
        config=dict(vars(args)),
        samples=[
            {"max_concurrent": r["max_concurrent"], "journal": r["journal"], "latencies_s": r["latencies_s"]}
            for r in runs
        ],
        summary=summary,
        plot=lambda png: _plot(runs, png),
        out_dir=args.results_dir,
    )
    print(path)
    return path


if __name__ == "__main__":
    main()
