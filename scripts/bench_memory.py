"""What a generating session holds, by KV arm, through the daemon: its reported bytes, the process's RSS and its
decode speed, side by side in one run.

One `kakeya-runtime serve` per arm runs on a loopback port with the daemon's default flags plus the arm's (and
`--model`). For every history length a session of that much held-out standard-library source is created and
prefilled; each repeat forks it and generates `--new-tokens` greedy tokens through the Python SDK while a sampler
reads the fork's `kv_live_bytes` (GetSessionInfo) and the daemon's resident set size (/proc) every 20 ms (what a
session holds while generating is allocated when the generation starts and grows by a token's worth per step, so
a denser sampling finds the same peaks and slows the daemon more). A fork is a new session, so what it holds while
generating is the whole history's K/V in that arm's form. Every arm's daemon runs for the whole bench and the arms
take turns, repeat by repeat in alternating order, so a noisy machine's slow spells fall on all of them alike (each
RSS is still its own process's; the others sit idle meanwhile).

Reported per arm and history: the most bytes the generating session held (`peak_session_bytes`: the larger of the
sampled `kv_live_bytes` and the `kv_peak_bytes` it reports after the generation), the most the session held while
it was prefilled (`prefill_peak_bytes`: its `kv_peak_bytes` after the prefill, each forward's staged block
included), what it holds parked after
(`parked_session_bytes`), the daemon's RSS above its RSS before the fork (`peak_rss_growth_bytes`), the median
decode tokens/s, the ratios of both to the `full` arm, and whether its tokens equal `full`'s; the generated tokens
per verifier forward and, from them, the ratio of verifier forwards per second to `full`'s (`forward_rate_vs_full`:
what one forward costs, apart from how many drafted tokens the proposer's blocks accept on the text an arm
generates, which a lossy arm's parting tokens change). Also the medians of
the time to first token (`ttft_s`: a fork's first generation unpacks what its arm holds parked) and of the wait for
the park after the generation (`park_wait_s`: an empty AppendTokens sent the moment the generation ended returns
when the session's turn is free, as a client's next turn would start), and the time to first token of that next
turn (`next_turn_ttft_s`: `NEXT_TURN_TOKENS` more tokens appended to the same session, then a generation): it
starts from what the session holds between turns, packed codes or, for the one that rests
(`--kv-resting-sessions`), its lattice coordinates. `kakeya_d4_packing` is `kakeya_d4` with every session packing.

Writes `results/bench_memory_<stamp>.json` and a PNG plot next to it.

Usage:
    python scripts/bench_memory.py [--model NAME|DIR|GGUF] [--histories 1024,4096,8192] [--arms full,kakeya_d4]
        [--new-tokens 32] [--repeats 3] [--out results]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kakeya
from lib.daemon import Daemon
from lib.decode_arms import history_tokens, timed_tokens
from lib.model_option import add_model_option
from lib.results import RESULTS_DIR, write_results
from lib.sampler import PeriodicSampler, rss_bytes

ARMS: dict[str, list[str]] = {
    "full": ["--kv-strategy", "full"],
    "full_float32": ["--kv-strategy", "full", "--kv-dtype", "model"],  # float32 K/V whatever auto holds
    "sink_window": ["--kv-strategy", "sink_window"],
    "dlm_restore": ["--kv-strategy", "dlm_restore", "--restore-plan", "recompute"],
    "dlm_restore_plan": ["--kv-strategy", "dlm_restore"],  # the model's own plan (recompute where it ships none)
    "kakeya_d4": ["--kv-compressor", "kakeya_d4"],
    "kakeya_d4_packing": ["--kv-compressor", "kakeya_d4", "--kv-resting-sessions", "0"],
}
ARMS["dlm_restore+kakeya_d4"] = ARMS["dlm_restore"] + ARMS["kakeya_d4"]  # restored K/V coded as the residents are
EXACT_ARMS = ("full", "dlm_restore")  # arms whose tokens must equal full's
SAMPLE_S = 0.02
NEXT_TURN_TOKENS = 16  # appended before a session's next turn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(p, "the model every arm's daemon serves")
    p.add_argument("--histories", default="1024,4096,8192", help="history lengths in tokens, comma-separated")
    p.add_argument("--arms", default=",".join(ARMS), help=f"arms, comma-separated, from {', '.join(ARMS)}")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    args.histories = [int(h) for h in args.histories.split(",") if h]
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown or "full" not in args.arms:
        p.error(f"unknown arms {unknown}; the arms must include full (every ratio is to it)")
    if args.new_tokens < 2 or args.repeats < 1 or not args.histories:
        p.error("--new-tokens >= 2, --repeats >= 1 and at least one history are required")
    return args


class Sampler(PeriodicSampler):
    """Samples a session's reported bytes and the daemon's RSS until stopped; keeps the maxima."""

    def __init__(self, session: Any, pid: int) -> None:
        super().__init__(SAMPLE_S)
        self._session, self._pid = session, pid
        self.peak_session = self.peak_rss = 0
        self.samples = 0

    def sample(self) -> None:
        self.peak_session = max(self.peak_session, self._session.info().kv_live_bytes)
        self.peak_rss = max(self.peak_rss, rss_bytes(self._pid))
        self.samples += 1


def measure(args: argparse.Namespace, text: list[int]) -> list[dict[str, Any]]:
    """Every arm's daemon started at once; per history and repeat the arms take their turns, in alternating order,
    so a noisy machine's slow spells fall on all of them alike."""
    daemons = {arm: Daemon(["--model", str(args.model), *ARMS[arm]]) for arm in args.arms}
    samples = []
    try:
        clients = {arm: kakeya.Client(daemon.wait_listening()) for arm, daemon in daemons.items()}
        for history in args.histories:
            held, prefill_peaks = {}, {}
            for arm, client in clients.items():
                held[arm] = client.create_session(initial_tokens=text[:history], eos_token_ids=[])
                list(held[arm].generate(1))  # the prefill
                held[arm].append([])  # waits for its park
                prefill_peaks[arm] = held[arm].info().kv_peak_bytes  # its prefill forwards' stages included
            for repeat in range(args.repeats):
                for arm in args.arms if repeat % 2 == 0 else args.arms[::-1]:
                    sample = measure_fork(held[arm], daemons[arm].process.pid, args, text, history)
                    samples.append(
                        {
                            "arm": arm,
                            "history": history,
                            "repeat": repeat,
                            "prefill_peak_bytes": prefill_peaks[arm],
                            **sample,
                        }
                    )
                    peak, rss = sample["peak_session_bytes"] / 2**20, sample["peak_rss_bytes"] / 2**20
                    print(
                        f"{arm:>12} history {history:>6}: {sample['decode_tokens_per_s']:6.1f} tok/s, session peak "
                        f"{peak:7.1f} MiB, RSS {rss:7.1f} MiB",
                        flush=True,
                    )
            for session in held.values():
                session.close()
        for client in clients.values():
            client.close()
    finally:
        for daemon in daemons.values():
            daemon.stop()
    return samples


def measure_fork(held: Any, pid: int, args: argparse.Namespace, text: list[int], history: int) -> dict[str, Any]:
    """One repeat: a fork of the prefilled session `held` generates while the sampler watches it, parks, and takes
    its next turn."""
    with held.fork() as fork:
        before = rss_bytes(pid)
        with Sampler(fork, pid) as sampler:
            result = timed_tokens(fork.generate(args.new_tokens), time.perf_counter())
            done_at = time.perf_counter()
            stats = fork.last_generation
            fork.append([])  # waits for the session's turn: the park after the generation
            park_wait = time.perf_counter() - done_at
        described = fork.info()  # parked now; its kv_peak_bytes counts every step's
        fork.append(text[history : history + NEXT_TURN_TOKENS])
        next_turn = timed_tokens(fork.generate(args.new_tokens), time.perf_counter())
    return {
        "peak_session_bytes": max(sampler.peak_session, described.kv_peak_bytes),
        "reported_peak_bytes": described.kv_peak_bytes,
        "sampled_peak_bytes": sampler.peak_session,
        "parked_session_bytes": described.kv_live_bytes,
        "rss_before_bytes": before,
        "peak_rss_bytes": sampler.peak_rss,
        "peak_rss_growth_bytes": max(0, sampler.peak_rss - before),
        "byte_samples": sampler.samples,
        "park_wait_s": park_wait,
        "next_turn_ttft_s": next_turn["ttft_s"],
        "verifier_forwards": 0 if stats is None else stats.verifier_forward_count,
        **result,
    }


def summarise(samples: list[dict[str, Any]], arms: list[str], histories: list[int]) -> dict[str, Any]:
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for arm in arms:
        table[arm] = {}
        for history in histories:
            runs = [s for s in samples if s["arm"] == arm and s["history"] == history]
            full = [s for s in samples if s["arm"] == "full" and s["history"] == history]
            row = {
                "peak_session_bytes": max(s["peak_session_bytes"] for s in runs),
                "prefill_peak_bytes": max(s["prefill_peak_bytes"] for s in runs),
                "parked_session_bytes": max(s["parked_session_bytes"] for s in runs),
                "peak_rss_bytes": max(s["peak_rss_bytes"] for s in runs),
                "peak_rss_growth_bytes": max(s["peak_rss_growth_bytes"] for s in runs),
                "decode_tokens_per_s": round(statistics.median(s["decode_tokens_per_s"] for s in runs), 2),
                "ttft_s": round(statistics.median(s["ttft_s"] for s in runs), 3),
                "park_wait_s": round(statistics.median(s["park_wait_s"] for s in runs), 3),
                "next_turn_ttft_s": round(statistics.median(s["next_turn_ttft_s"] for s in runs), 3),
                "tokens_equal_full": all(s["tokens"] == f["tokens"] for s, f in zip(runs, full, strict=True)),
                "tokens_per_forward": round(_tokens_per_forward(runs), 3),
            }
            full_peak = max(s["peak_session_bytes"] for s in full)
            full_rate = statistics.median(s["decode_tokens_per_s"] for s in full)
            row["peak_vs_full"] = round(row["peak_session_bytes"] / full_peak, 3)
            full_prefill_peak = max(s["prefill_peak_bytes"] for s in full)
            row["prefill_peak_vs_full"] = round(row["prefill_peak_bytes"] / full_prefill_peak, 3)
            row["speed_vs_full"] = round(row["decode_tokens_per_s"] / full_rate, 3)
            # The proposer's blocks accept more or fewer tokens on different text (a lossy arm's tokens can part
            # from full's): the verifier forwards per second compare what one forward costs.
            row["forward_rate_vs_full"] = round(
                row["speed_vs_full"] * _tokens_per_forward(full) / _tokens_per_forward(runs), 3
            )
            table[arm][str(history)] = row
    statement = "; ".join(
        f"{arm} at {h}: peak {row['peak_vs_full']:.2f}x full's, {row['speed_vs_full']:.2f}x its speed "
        f"({row['forward_rate_vs_full']:.2f}x its forwards/s), prefill peak {row['prefill_peak_vs_full']:.2f}x full's"
        for arm, rows in table.items()
        if arm != "full"
        for h, row in rows.items()
    )
    exact = {arm: all(r["tokens_equal_full"] for r in table[arm].values()) for arm in arms if arm in EXACT_ARMS}
    return {"arms": table, "exact_arms_equal_full": exact, "statement": statement}


def _tokens_per_forward(runs: list[dict[str, Any]]) -> float:
    """Generated tokens per verifier forward over `runs` (nan where the daemon reported no forwards)."""
    forwards = sum(s.get("verifier_forwards", 0) for s in runs)
    return sum(len(s["tokens"]) for s in runs) / forwards if forwards else float("nan")


def plot(png: Path, summary: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, rows in summary["arms"].items():
        histories = [int(h) for h in rows]
        left.plot(histories, [r["peak_session_bytes"] / 2**20 for r in rows.values()], marker="o", label=arm)
        right.plot(histories, [r["decode_tokens_per_s"] for r in rows.values()], marker="o", label=arm)
    left.set_xlabel("history tokens")
    left.set_ylabel("generating session's peak bytes (MiB)")
    right.set_xlabel("history tokens")
    right.set_ylabel("decode tokens/s (median)")
    left.legend()
    fig.suptitle("what a generating session holds, by KV arm")
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text = history_tokens(args.model, max(args.histories) + NEXT_TURN_TOKENS)
    samples = measure(args, text)
    summary = summarise(samples, args.arms, args.histories)
    config = {**vars(args), "model": str(args.model), "out": str(args.out)}
    path = write_results(
        "bench_memory",
        config=config,
        samples=samples,
        summary=summary,
        plot=lambda png: plot(png, summary),
        out_dir=args.out,
    )
    print(summary["statement"])
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
