"""Held-out acceptance of DFlash drafters under each context window, by prompt length.

The held-out prompts of a prompt file (`scripts/make_drafter_prompts.py`: prompts from corpus files no drafter
trained on, of lengths up to the model's context) are continued greedily by the verifier; every drafter is then
scored at every continuation position, as greedy speculative decoding would accept there, with each drafter layer
reading only the last W context positions for each `--windows` entry (0: the whole context). This is how a
drafter's serving window is chosen: the smallest window at the plateau of acceptance, since a session's drafter
holds that many positions.

Writes `results/bench_drafter_windows_<stamp>.json` and a PNG (acceptance by prompt length, one line per drafter
and window).

Usage:
    python scripts/bench_drafter_windows.py --prompts PROMPTS.npz --drafters DIR [DIR ...]
        [--model NAME|DIR|GGUF] [--windows 0 64 128 256 512] [--held 64] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.drafter_eval import row_acceptance
from lib.model_option import add_model_option
from lib.prompt_rows import PromptSet, prompt_continuations, stop_token_ids
from lib.results import RESULTS_DIR, write_results

from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.proposers.dflash.checkpoint import load_drafter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(p, "the verifier")
    p.add_argument("--prompts", required=True, type=Path, help="a prompt file: its held-out prompts are used")
    p.add_argument("--drafters", required=True, type=Path, nargs="+", help="DFlash drafter directories")
    p.add_argument("--windows", type=int, nargs="+", default=[0, 64, 128, 256, 512], help="0: the whole context")
    p.add_argument("--held", type=int, default=64, help="held-out prompts used (spread over the file's)")
    p.add_argument("--new-tokens", type=int, default=128, help="most tokens continued per prompt")
    p.add_argument("--block-size", type=int, default=0, help="block scored (0: each drafter's own)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    if any(w < 0 for w in args.windows) or args.held < 1 or args.new_tokens < 2:
        p.error("windows must be >= 0, --held >= 1 and --new-tokens >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    verifier = TorchVerifier.load(args.model, device="cpu", dtype="float32")
    prompts = PromptSet.load(args.prompts)
    spread = np.linspace(0, len(prompts.held) - 1, min(args.held, len(prompts.held))).astype(int)
    held = prompt_continuations(
        verifier,
        [prompts.held[i] for i in spread],
        new_tokens=args.new_tokens,
        stop_ids=stop_token_ids(args.model),
        token_budget=65536,
        max_rows=64,
        desc="held-out continuations",
    )
    kept = held.scored()
    samples: list[dict[str, Any]] = []
    for directory in args.drafters:
        drafter, spec = load_drafter(directory, device=torch.device("cpu"), dtype=torch.float32)
        scoring = argparse.Namespace(block_size=args.block_size or spec.block_size, gamma=4.0)
        per_window = row_acceptance(drafter, spec, verifier, held, scoring, args.windows)
        for window, values in per_window.items():
            for index, acceptance in zip(kept, values, strict=True):
                samples.append(
                    {
                        "drafter": str(directory),
                        "window": window,
                        "prompt_tokens": int(held.first_anchor[index]),
                        "acceptance": acceptance,
                    }
                )
    buckets = [0, 128, 512, 2048, 1 << 30]
    summary: dict[str, Any] = {}
    for directory in args.drafters:
        by_window: dict[str, Any] = {}
        for window in args.windows:
            rows = [s for s in samples if s["drafter"] == str(directory) and s["window"] == window]
            by_length = {
                f"{low}-{high if high < 1 << 30 else 'max'}": round(
                    float(np.mean([r["acceptance"] for r in rows if low <= r["prompt_tokens"] < high] or [0])), 3
                )
                for low, high in pairwise(buckets)
            }
            by_window[str(window)] = {"mean": round(float(np.mean([r["acceptance"] for r in rows])), 3), **by_length}
        summary[str(directory)] = by_window
        print(directory, {w: v["mean"] for w, v in by_window.items()})

    def plot(png: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for directory in args.drafters:
            for window in args.windows:
                rows = sorted(
                    (s["prompt_tokens"], s["acceptance"])
                    for s in samples
                    if s["drafter"] == str(directory) and s["window"] == window
                )
                xs = [r[0] for r in rows]
                width = max(1, min(5, len(rows)))
                smooth = np.convolve([r[1] for r in rows], np.ones(width) / width, mode="same")
                ax.plot(xs, smooth, label=f"{Path(directory).name} window {window or 'all'}")
        ax.set(xscale="log", xlabel="prompt tokens", ylabel="held-out acceptance length (5-row mean)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        plt.close(fig)

    config = {
        "model": str(args.model_name),
        "prompts": str(args.prompts),
        "drafters": [str(d) for d in args.drafters],
        "windows": args.windows,
        "held_rows": len(kept),
        "new_tokens": args.new_tokens,
    }
    path = write_results(
        "bench_drafter_windows", config=config, samples=samples, summary=summary, plot=plot, out_dir=args.results_dir
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
