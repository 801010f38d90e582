"""Daemon decode speed by CPU thread count and OpenMP wait, on an idle machine and on one kept busy by other work.

One daemon (`kakeya-runtime serve`, its default flags otherwise) per (wait, threads) pair: `--threads N` and the
environment of the wait choice (`inference_engine.threads.WAITS`: `spin`, the daemon's default on Linux, spins
briefly and then sleeps; `passive` sleeps at once). Each holds a session with the same `--history-tokens` history
and decodes `--max-tokens` greedy tokens from a fork of it per measurement, through the Python SDK. For each
`--busy` count that many processes spin on the CPU during the measurement, standing in for the other work of a
shared machine. Repeats visit every (busy, wait, threads) triple in turn, so machine noise hits them alike; the
summary holds medians and, per load and thread count, each wait's rate over `passive`'s.

Usage:
    python scripts/bench_threads.py [--model NAME|DIR|GGUF] [--threads 1 2] [--waits spin passive] [--busy 0 2]
        [--history-tokens 1024] [--max-tokens 64] [--repeats 3] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.daemon import Daemon
from lib.model_option import add_model_option
from lib.results import RESULTS_DIR, write_results

from inference_engine.threads import WAITS, usable_cores


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cores = usable_cores()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(p, "the verifier")
    p.add_argument(
        "--threads", type=int, nargs="+", default=sorted({1, cores}), help="thread counts (default: 1 and cores)"
    )
    p.add_argument(
        "--waits", nargs="+", choices=sorted(WAITS), default=sorted(WAITS, reverse=True), help="OpenMP waits"
    )
    p.add_argument(
        "--busy", type=int, nargs="+", default=[0, cores], help="busy processes per arm (default: 0 and cores)"
    )
    p.add_argument("--history-tokens", type=int, default=1024, help="session history before decoding (default 1024)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens decoded per measurement (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per triple (default 3)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON and PNG go")
    args = p.parse_args(argv)
    if min(args.threads) < 1 or min(args.busy) < 0 or args.repeats < 1 or args.max_tokens < 2:
        p.error("--threads >= 1, --busy >= 0, --repeats >= 1 and --max-tokens >= 2 are required")
    if args.history_tokens < 1:
        p.error("--history-tokens must be at least 1")
    return args


def _spin(stop: Any) -> None:
    while not stop.is_set():
        for _ in range(100_000):
            pass


class Arm:
    """One daemon at one (wait, threads), holding a session with the history."""

    def __init__(self, model: Path, wait: str, threads: int, history: list[int]) -> None:
        import kakeya

        self.wait, self.threads = wait, threads
        # the other variables any wait sets are cleared, so each daemon sees only its own choice
        env: dict[str, str | None] = {name: None for choice in WAITS.values() for name in choice}
        env |= WAITS[wait]
        self.daemon = Daemon(["--model", str(model), "--threads", str(threads), "--proposer", "none"], env=env)
        self.client = kakeya.Client(self.daemon.wait_listening())
        self.session = self.client.create_session(initial_tokens=history, eos_token_ids=[])
        list(self.session.generate(1))

    def tokens_per_s(self, max_tokens: int) -> float:
        """Decode rate of `max_tokens` greedy tokens from a fork: (tokens - 1) over first to last token."""
        with self.session.fork() as session:
            stamps = [time.perf_counter() for _ in session.generate(max_tokens)]
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def close(self) -> None:
        self.client.close()
        self.daemon.stop()


def measure(arm: Arm, busy: int, max_tokens: int) -> float:
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    spinners = [context.Process(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
    for spinner in spinners:
        spinner.start()
    try:
        return arm.tokens_per_s(max_tokens)
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join(10)


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    by_busy: dict[str, Any] = {}
    for busy in sorted({s["busy"] for s in samples}):
        rates = {
            wait: {
                str(threads): round(
                    statistics.median(
                        s["tokens_per_s"]
                        for s in samples
                        if (s["busy"], s["wait"], s["threads"]) == (busy, wait, threads)
                    ),
                    2,
                )
                for threads in sorted({s["threads"] for s in samples})
            }
            for wait in sorted({s["wait"] for s in samples})
        }
        part: dict[str, Any] = {"tokens_per_s": rates}
        if "passive" in rates:
            part["over_passive"] = {
                wait: {t: round(r / rates["passive"][t], 3) for t, r in by_threads.items()}
                for wait, by_threads in rates.items()
                if wait != "passive"
            }
        by_busy[f"busy_{busy}"] = part
    return {"by_busy_processes": by_busy}


def plot(summary: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for busy, part in summary["by_busy_processes"].items():
        for wait, by_threads in part["tokens_per_s"].items():
            ax.plot(
                [int(t) for t in by_threads],
                list(by_threads.values()),
                marker="o",
                linestyle="-" if wait == "spin" else "--",
                label=f"{wait}, {busy.replace('_', ' ')}",
            )
    ax.set_xlabel("--threads")
    ax.set_ylabel("daemon decode tokens / s")
    ax.set_title("daemon greedy decode by threads and OpenMP wait")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model, local_files_only=True).vocab_size
    history = [(i * 7919) % vocab for i in range(1, args.history_tokens + 1)]
    arms: list[Arm] = []
    samples = []
    try:
        for wait in args.waits:
            for threads in args.threads:
                arms.append(Arm(args.model, wait, threads, history))
        for repeat in range(args.repeats):
            for busy in args.busy:
                for arm in arms:
                    rate = measure(arm, busy, args.max_tokens)
                    samples.append(
                        {"repeat": repeat, "busy": busy, "wait": arm.wait, "threads": arm.threads, "tokens_per_s": rate}
                    )
                    print(f"busy {busy} {arm.wait} threads {arm.threads}: {rate:.1f} tok/s", file=sys.stderr)
    finally:
        for arm in arms:
            arm.close()
    summary = summarize(samples)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "results_dir"}
    path = write_results(
        "bench_threads",
        config=config,
        samples=samples,
        summary=summary,
        plot=lambda p: plot(summary, p),
        out_dir=args.results_dir,
        environment_extra={"cores": usable_cores(), "waits": WAITS},
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
