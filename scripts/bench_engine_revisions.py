"""Benchmark the engine's decode step at two revisions of this repository, side by side in one run.

The baseline revision is exported from git (`git archive`) into a temporary directory; the current working tree is
the other side. For each (revision, backend) one worker process imports the engine from its own tree and keeps
the same model loaded; the parent asks the workers for generations in alternating order, so both revisions share
whatever else the machine is doing. Each generation prefills `--history-tokens` tokens of a fixed random history
into a fresh session cache (`full`, or `sink_window` with `--sink`/`--window`) and decodes `--new-tokens` greedy
tokens through `Decoder.step` (no proposer), the loop a daemon generation runs without the gRPC transport. It
records the time to the first token and the decode rate after it, checks that both revisions produced the same
tokens, and writes `results/bench_engine_revisions_<stamp>.json` (config, environment, raw samples, summary with the
current / baseline ratios) and a PNG plot next to it.

Usage:
    python scripts/bench_engine_revisions.py --baseline REV [--backends torch,mlx] [--strategies full,sink_window]
        [--history-tokens 1024] [--new-tokens 128] [--repeats 7] [--sink 4] [--window 256] [--threads 1]
        [--kv-compressor none|kakeya_d4s:38|...]
        [--model NAME|DIR|GGUF] [--out results]
    python scripts/bench_engine_revisions.py --baseline HEAD --smoke    # seconds-long run with tiny sizes (tests)

    --model takes a model name, a model directory or a GGUF file, as `kakeya-runtime serve --model` does (default:
    kakeya-tiny, whose directory serves both backends).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib import revisions
from lib.model_option import add_model_option
from lib.results import write_results

ROOT = Path(__file__).resolve().parent.parent
REVISIONS = ("baseline", "current")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="git revision to compare the working tree with")
    p.add_argument("--backends", default="torch,mlx")
    p.add_argument("--strategies", default="full,sink_window")
    p.add_argument("--history-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument(
        "--kv-compressor",
        default="none",
        help="the sessions' KV compressor, as `serve --kv-compressor` takes it (kakeya_d4s:38: packed K/V)",
    )
    p.add_argument("--threads", type=int, default=1, help="CPU threads of torch and the BLAS in each worker")
    add_model_option(p, "the model both revisions load")
    p.add_argument("--out", type=Path, default=ROOT / "results")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for tests")
    p.add_argument("--worker", nargs=2, metavar=("TREE", "BACKEND"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.history_tokens, args.new_tokens, args.repeats, args.window = 24, 6, 1, 8
    if args.history_tokens < 1 or args.new_tokens < 2 or args.repeats < 1:
        p.error("--history-tokens >= 1, --new-tokens >= 2 and --repeats >= 1 are required")
    return args


# -- the worker: one tree, one backend, one loaded model ---------------------------------------------------------
def serve_worker(tree: Path, backend: str, args: argparse.Namespace) -> int:
    """Answer generation requests (one JSON line per request on stdin) with timings and tokens on stdout."""
    sys.path.insert(0, str(tree))
    import kv_cache_proposer
    from kv_cache_proposer.backends import load_verifier
    from kv_cache_proposer.compression import KVCompressor, compressor_layer_store
    from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
    from kv_cache_proposer.sampling import SamplingParams
    from kv_cache_proposer.strategies import FullStrategy, SinkWindowStrategy

    if not Path(kv_cache_proposer.__file__).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"imported the engine from {kv_cache_proposer.__file__}, not from {tree}")
    if backend == "torch":
        import torch

        torch.set_num_threads(args.threads)
    verifier = load_verifier(backend, args.model, device="cpu", dtype="float32")
    history = [(i * 7919 + 13) % verifier.vocab_size for i in range(args.history_tokens)]
    layer_store = compressor_layer_store(backend, KVCompressor.parse(args.kv_compressor))
    print(json.dumps({"ready": True, "engine": str(Path(kv_cache_proposer.__file__).parent)}), flush=True)
    for line in sys.stdin:
        strategy_name = json.loads(line)["strategy"]
        strategy = FullStrategy() if strategy_name == "full" else SinkWindowStrategy(sink=args.sink, window=args.window)
        decoder = Decoder(verifier, prefill_chunk_tokens=512)
        seq = SequenceState(cache=verifier.new_cache(strategy, layer_store=layer_store), tokens=list(history))
        budget, params = GenerationBudget(max_new_tokens=args.new_tokens), SamplingParams()
        tokens: list[int] = []
        started = time.perf_counter()
        first = started
        while len(tokens) < args.new_tokens:
            tokens += decoder.step(seq, params, budget, len(tokens)).tokens
            if first == started and tokens:
                first = time.perf_counter()
        finished = time.perf_counter()
        rate = (len(tokens) - 1) / (finished - first)
        print(json.dumps({"ttft_s": first - started, "decode_tokens_per_s": rate, "tokens": tokens}), flush=True)
    return 0


# -- the parent ----------------------------------------------------------------------------------------------------
class Worker:
    """A worker process and its pipes."""

    def __init__(self, tree: Path, backend: str, args: argparse.Namespace) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": ""}
        command = [sys.executable, str(Path(__file__).resolve()), "--baseline", args.baseline, "--worker"]
        command += [str(tree), backend, *_forwarded(args)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.engine = self._read()["engine"]

    def _read(self) -> dict[str, Any]:
        stdout: IO[str] | None = self.process.stdout
        line = stdout.readline() if stdout is not None else ""
        if not line:
            raise RuntimeError(f"worker exited with {self.process.wait()}")
        return dict(json.loads(line))

    def generate(self, strategy: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"strategy": strategy}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


def _forwarded(args: argparse.Namespace) -> list[str]:
    return [
        f"--history-tokens={args.history_tokens}",
        f"--new-tokens={args.new_tokens}",
        f"--sink={args.sink}",
        f"--window={args.window}",
        f"--threads={args.threads}",
        f"--kv-compressor={args.kv_compressor}",
        f"--model={args.model}",
    ]


def export_revision(revision: str, target: Path) -> str:
    """The engine package at `revision`, unpacked under `target`; returns the full commit id."""
    return revisions.export_revision(revision, target, ("kv_cache_proposer",), tool="bench_engine_revisions")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return serve_worker(Path(args.worker[0]), args.worker[1], args)
    backends = [b for b in args.backends.split(",") if b]
    strategies = [s for s in args.strategies.split(",") if s]
    if not set(strategies) <= {"full", "sink_window"}:
        raise SystemExit("bench_engine_revisions: --strategies takes full and/or sink_window")
    samples: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="kakeya-baseline-") as tmp:
        baseline_commit = export_revision(args.baseline, Path(tmp))
        trees = {"baseline": Path(tmp), "current": ROOT}
        workers = {(rev, b): Worker(trees[rev], b, args) for rev in REVISIONS for b in backends}
        try:
            for repeat in range(args.repeats):
                order = REVISIONS if repeat % 2 == 0 else REVISIONS[::-1]
                for backend in backends:
                    for strategy in strategies:
                        for rev in order:
                            run = workers[(rev, backend)].generate(strategy)
                            samples.setdefault(f"{rev}/{backend}/{strategy}", []).append(run)
                print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
            engines = {f"{rev}/{b}": w.engine for (rev, b), w in workers.items()}
        finally:
            for worker in workers.values():
                worker.close()
    summary = summarise(samples, backends, strategies)
    config = {**{k: v for k, v in vars(args).items() if k != "worker"}, "baseline_commit": baseline_commit}
    path = write_results(
        "bench_engine_revisions",
        config=config,
        samples=samples,
        summary=summary,
        plot=lambda png: plot(png, summary, backends, strategies),
        out_dir=args.out,
        environment_extra={"engines": engines},
    )
    print(summary["statement"])
    print(path)
    return 0


def summarise(samples: dict[str, list[dict[str, Any]]], backends: list[str], strategies: list[str]) -> dict[str, Any]:
    medians: dict[str, dict[str, float]] = {}
    ratios: dict[str, float] = {}
    paired: dict[str, float] = {}
    identical = True
    for backend in backends:
        for strategy in strategies:
            arm = f"{backend}/{strategy}"
            runs = {rev: samples[f"{rev}/{arm}"] for rev in REVISIONS}
            medians[arm] = {
                **{
                    f"{rev}_decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs[rev])
                    for rev in REVISIONS
                },
                **{f"{rev}_ttft_s": statistics.median(r["ttft_s"] for r in runs[rev]) for rev in REVISIONS},
            }
            ratios[arm] = medians[arm]["current_decode_tokens_per_s"] / medians[arm]["baseline_decode_tokens_per_s"]
            # Runs of one repeat ran back to back, so their ratio cancels most of the machine's drift.
            paired[arm] = statistics.median(
                c["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                for c, b in zip(runs["current"], runs["baseline"], strict=True)
            )
            identical &= all(a["tokens"] == b["tokens"] for a, b in zip(runs["baseline"], runs["current"], strict=True))
    statement = "; ".join(
        f"{arm} current/baseline decode {ratios[arm]:.2f}x (paired {paired[arm]:.2f}x)" for arm in ratios
    )
    return {
        "medians": medians,
        "decode_tokens_per_s_ratio": ratios,
        "paired_decode_ratio_median": paired,
        "min_ratio": min(ratios.values()),
        "min_paired_ratio": min(paired.values()),
        "tokens_identical": identical,
        "statement": statement + ("" if identical else "; TOKENS DIFFER"),
    }


def plot(png: Path, summary: dict[str, Any], backends: list[str], strategies: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [f"{b}/{s}" for b in backends for s in strategies]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(arms), 3.6))
    width = 0.38
    for i, rev in enumerate(REVISIONS):
        values = [summary["medians"][arm][f"{rev}_decode_tokens_per_s"] for arm in arms]
        ax.bar([x + (i - 0.5) * width for x in range(len(arms))], values, width, label=rev)
    for x, arm in enumerate(arms):
        ax.annotate(f"{summary['decode_tokens_per_s_ratio'][arm]:.2f}x", (x, 0), ha="center", va="bottom")
    ax.set_xticks(range(len(arms)), arms)
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title("Engine decode step: current tree vs baseline revision")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
