"""Decode speed by CPU thread count, on an idle machine and on one whose cores are kept busy by other processes.

Greedy decoding of the same prompt with the torch verifier, once per (busy processes, threads) pair, repeats
interleaved so machine noise hits every pair alike. "Busy" processes spin on the CPU for the length of a
measurement, standing in for the other work of a shared machine. The daemon's `--threads 0` default
(`inference_engine/threads.py`) is the count this measures fastest for small models under load.

OpenMP's wait policy is read when torch loads, so compare policies by running the script twice
(`OMP_WAIT_POLICY=PASSIVE python scripts/bench_threads.py ...`); the results record it.

Usage:
    python scripts/bench_threads.py [--model NAME|DIR|GGUF] [--threads 1 2 4] [--busy 0 2] [--prompt-tokens 64]
        [--max-tokens 32] [--repeats 2] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.model_option import add_model_option
from lib.results import RESULTS_DIR, write_results

from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.proposers.base import NoProposer
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(p, "the verifier")
    p.add_argument(
        "--threads", type=int, nargs="+", default=sorted({1, 2, cores}), help="thread counts (default: 1 2 cores)"
    )
    p.add_argument(
        "--busy", type=int, nargs="+", default=[0, cores], help="busy processes per arm (default: 0 and cores)"
    )
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default 64)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens decoded per measurement (default 32)")
    p.add_argument("--repeats", type=int, default=2, help="measurements per pair (default 2)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON and PNG go")
    args = p.parse_args(argv)
    if min(args.threads) < 1 or min(args.busy) < 0 or args.repeats < 1 or args.max_tokens < 1:
        p.error("--threads >= 1, --busy >= 0, --repeats >= 1 and --max-tokens >= 1 are required")
    return args


def _spin(stop: Any) -> None:
    while not stop.is_set():
        for _ in range(100_000):
            pass


def decode_tokens_per_s(verifier: TorchVerifier, prompt: list[int], max_tokens: int) -> float:
    """Greedy decode of `max_tokens` after `prompt` (prefill excluded from the clock)."""
    decoder = Decoder(verifier, burst_tokens=1)  # one forward per step: the threads' effect on a forward
    strategy = FullStrategy()
    seq = SequenceState(
        cache=verifier.new_cache(strategy), tokens=list(prompt), draft_session=NoProposer().open(strategy)
    )
    budget = GenerationBudget(max_new_tokens=max_tokens + 1)
    generated = len(decoder.step(seq, SamplingParams(), budget, 0).tokens)  # prefill and the first token
    started = time.perf_counter()
    while generated < max_tokens + 1:
        step = decoder.step(seq, SamplingParams(), budget, generated)
        generated += len(step.tokens)
        if step.stop is not None:
            break
    seconds = time.perf_counter() - started
    seq.cache.release()
    return (generated - 1) / seconds


def measure(verifier: TorchVerifier, prompt: list[int], threads: int, busy: int, max_tokens: int) -> float:
    torch.set_num_threads(threads)
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    spinners = [context.Process(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
    for spinner in spinners:
        spinner.start()
    try:
        return decode_tokens_per_s(verifier, prompt, max_tokens)
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join(10)


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    arms: dict[str, Any] = {}
    for busy in sorted({s["busy"] for s in samples}):
        rates = {
            threads: statistics.median(
                s["tokens_per_s"] for s in samples if s["busy"] == busy and s["threads"] == threads
            )
            for threads in sorted({s["threads"] for s in samples})
        }
        fastest = max(rates, key=lambda t: rates[t])
        arms[f"busy_{busy}"] = {
            "tokens_per_s_by_threads": {str(t): round(r, 2) for t, r in rates.items()},
            "fastest_threads": fastest,
            "slowest_over_fastest": round(min(rates.values()) / rates[fastest], 3),
        }
    return {"by_busy_processes": arms}


def plot(summary: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, arm in summary["by_busy_processes"].items():
        threads = [int(t) for t in arm["tokens_per_s_by_threads"]]
        ax.plot(threads, list(arm["tokens_per_s_by_threads"].values()), marker="o", label=name.replace("_", " "))
    ax.set_xlabel("torch threads")
    ax.set_ylabel("decode tokens / s")
    ax.set_title("greedy decode speed by thread count")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    verifier = TorchVerifier.load(args.model, device="cpu", dtype="float32")
    prompt = [(i * 7919) % verifier.vocab_size for i in range(1, args.prompt_tokens + 1)]
    samples = []
    for repeat in range(args.repeats):
        for busy in args.busy:
            for threads in args.threads:
                rate = measure(verifier, prompt, threads, busy, args.max_tokens)
                samples.append({"repeat": repeat, "busy": busy, "threads": threads, "tokens_per_s": rate})
                print(f"busy {busy} threads {threads}: {rate:.1f} tok/s", file=sys.stderr)
    summary = summarize(samples)
    config = {k: v for k, v in vars(args).items() if k != "results_dir"}
    path = write_results(
        "bench_threads",
        config=config,
        samples=samples,
        summary=summary,
        plot=lambda p: plot(summary, p),
        out_dir=args.results_dir,
        environment_extra={"omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")},
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
