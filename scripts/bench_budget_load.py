"""Many sessions with long histories generating under one KV byte budget, through the daemon: errors, whether every
history stays consistent, and whether the budget holds while they generate.

One `kakeya-runtime serve` with `--max-concurrent` generations at once, `--kv-budget-bytes` and any `--flags`
(default: `--kv-compressor kakeya_d4`). `--sessions` sessions, each created with its own `--history` tokens of
held-out standard-library source, generate `--new-tokens` greedy tokens through the Python SDK, `--concurrency` of
them at a time (one SDK client per worker thread). A sampler reads the daemon's `kakeya_session_kv_live_bytes`
gauge (what every session holds now, refreshed at least every 0.25 s while generations run) and its RSS every
50 ms. When every session is done, each is described: a live one must hold its history and the tokens it
generated, in order; an evicted one (the budget evicts idle sessions, least recently used first) must answer
`SessionNotFound`.

Writes `results/bench_budget_load_<stamp>.json` and a PNG (held bytes and RSS over time, against the budget).

Usage:
    python scripts/bench_budget_load.py [--model NAME|DIR|GGUF] [--sessions 32] [--concurrency 8] [--history 4096]
        [--new-tokens 32] [--budget-bytes 1073741824] [--flags "--kv-compressor kakeya_d4"] [--out results]
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kakeya
from lib.daemon import Daemon, free_port
from lib.decode_arms import history_tokens
from lib.model_option import add_model_option
from lib.results import RESULTS_DIR, write_results
from lib.sampler import PeriodicSampler, rss_bytes

_LIVE = re.compile(r"^kakeya_session_kv_live_bytes (\S+)$", re.MULTILINE)
SAMPLE_S = 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(p, "the model the daemon serves")
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8, help="sessions generating at once (and --max-concurrent)")
    p.add_argument("--history", type=int, default=4096, help="history tokens of each session")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--budget-bytes", type=int, default=1 << 30, help="--kv-budget-bytes of the daemon")
    p.add_argument("--flags", default="--kv-compressor kakeya_d4", help="extra `serve` flags, one shell string")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    if min(args.sessions, args.concurrency, args.history, args.new_tokens, args.budget_bytes) < 1:
        p.error("every count must be positive")
    return args


class Sampler(PeriodicSampler):
    """Samples the daemon's held KV bytes (its gauge) and RSS until stopped."""

    def __init__(self, metrics_url: str, pid: int) -> None:
        super().__init__(SAMPLE_S)
        self._url, self._pid = metrics_url, pid
        self.samples: list[tuple[float, int, int]] = []  # (seconds since start, held bytes, RSS)
        self.missed = 0  # fetches of /metrics that failed

    def sample(self) -> None:
        try:
            text = urllib.request.urlopen(self._url, timeout=5).read().decode()
        except OSError:  # the metrics server not answering yet, or a timeout: a sample missed, sampling goes on
            self.missed += 1
            return
        match = _LIVE.search(text)
        held = int(float(match.group(1))) if match else 0
        self.samples.append((time.monotonic() - self.started, held, rss_bytes(self._pid)))


def run_session(address: str, index: int, text: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Create session `index` with its own history and generate; what it got, or the error it met."""
    start = (index * 1009) % max(1, len(text) - args.history)
    history = text[start : start + args.history]
    began = time.monotonic()
    with kakeya.Client(address, timeout_s=900.0) as client:
        try:
            session = client.create_session(initial_tokens=history, eos_token_ids=[])
            tokens = list(session.generate(args.new_tokens))
        except kakeya.KakeyaError as exc:
            return {"index": index, "error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - began}
    return {
        "index": index,
        "session_id": session.id,
        "history": history,
        "tokens": tokens,
        "error": None,
        "seconds": time.monotonic() - began,
    }


def check(address: str, outcome: dict[str, Any]) -> str:
    """`consistent`, `evicted` or what is wrong with a finished session's state on the daemon."""
    with kakeya.Client(address) as client:
        session = client.session(outcome["session_id"])
        expected = outcome["history"] + outcome["tokens"]
        try:
            described = session.info(history_tail_tokens=len(expected))
        except kakeya.SessionNotFound:
            return "evicted"
    if described.history_length != len(expected) or list(described.history_tail) != expected:
        return f"inconsistent: {described.history_length} tokens held, {len(expected)} expected"
    return "consistent"


def summarise(outcomes: list[dict[str, Any]], states: list[str], samples: list[Any], budget: int) -> dict[str, Any]:
    errors = [o["error"] for o in outcomes if o["error"]]
    held = [s[1] for s in samples]
    rss = [s[2] for s in samples]
    return {
        "errors": len(errors),
        "error_messages": errors[:5],
        "consistent": states.count("consistent"),
        "evicted": states.count("evicted"),
        "inconsistent": [s for s in states if s.startswith("inconsistent")],
        "max_held_bytes": max(held, default=0),
        "samples_over_budget": sum(1 for h in held if h > budget),
        "samples": len(samples),
        "rss_start_bytes": rss[0] if rss else 0,
        "max_rss_bytes": max(rss, default=0),
        "max_rss_growth_bytes": (max(rss) - rss[0]) if rss else 0,
        "budget_held": bool(held) and max(held) <= budget,
    }


def plot(png: Path, samples: list[Any], budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    times = [s[0] for s in samples]
    ax.plot(times, [s[1] / 2**20 for s in samples], label="KV bytes held (gauge)")
    ax.plot(times, [(s[2] - samples[0][2]) / 2**20 for s in samples], label="RSS above the start")
    ax.axhline(budget / 2**20, color="k", linestyle="--", label="--kv-budget-bytes")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.set_title("sessions generating under one KV budget")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text = history_tokens(args.model, 4 * args.history)  # each session starts at its own place in it
    metrics_port = free_port()
    flags = [
        "--model",
        str(args.model),
        "--max-concurrent",
        str(args.concurrency),
        "--kv-budget-bytes",
        str(args.budget_bytes),
        "--max-sessions",
        str(max(64, 2 * args.sessions)),
        "--metrics-port",
        str(metrics_port),
        *shlex.split(args.flags),
    ]
    daemon = Daemon(flags)
    try:
        address = daemon.wait_listening()
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        with Sampler(metrics, daemon.process.pid) as sampler, ThreadPoolExecutor(args.concurrency) as pool:
            outcomes = list(pool.map(lambda i: run_session(address, i, text, args), range(args.sessions)))
        states = [check(address, o) if o["error"] is None else "failed" for o in outcomes]
    finally:
        daemon.stop()
    summary = summarise(outcomes, states, sampler.samples, args.budget_bytes) | {"missed_samples": sampler.missed}
    config = {**vars(args), "model": str(args.model), "out": str(args.out), "daemon_flags": flags}
    for outcome in outcomes:
        outcome.pop("history", None)
    path = write_results(
        "bench_budget_load",
        config=config,
        samples={"sessions": outcomes, "states": states, "memory": sampler.samples},
        summary=summary,
        plot=lambda png: plot(png, sampler.samples, args.budget_bytes),
        out_dir=args.out,
    )
    print(
        f"{summary['errors']} errors, {summary['consistent']} consistent, {summary['evicted']} evicted, "
        f"{len(summary['inconsistent'])} inconsistent; most KV bytes held {summary['max_held_bytes'] / 2**20:.0f} MiB "
        f"of a {args.budget_bytes / 2**20:.0f} MiB budget ({summary['samples_over_budget']} of {summary['samples']} "
        f"samples over); RSS grew by {summary['max_rss_growth_bytes'] / 2**20:.0f} MiB"
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
