"""Needle-in-a-haystack recall over the running daemon, through the Python SDK, for any KV strategy.

For every KV strategy (`--kv-strategies`, side by side in one run: each session picks its own strategy), every
context length of the ladder (`--lengths`) and every needle depth (`--depths`, spread from the start to the end
of the filler), it builds documents of that many tokens: held-out standard-library source with the line
`# The secret code for KEY is VALUE.` inserted at that depth, ending with the question and the answer prefix
`# Answer: the secret code for KEY is`. Each document is one session created with it as initial history; the
daemon generates `--max-tokens` greedy tokens, and the sample recalls the needle when VALUE appears in their
decoded text. `--samples` documents per rung (context length) are spread evenly over the depths; the same
documents are used for every strategy.

Writes `results/eval_niah_<stamp>.json` (per-sample outcomes, recall per strategy x length x depth, recall per
strategy x length averaged over depths in `summary`) and a heat-map PNG with one panel per strategy.

Usage:
    python scripts/eval_niah.py [--address HOST:PORT | --model DIR] [--lengths 512,1024,2048] [--depths 5]
        [--samples 20] [--kv-strategies full,sink_window] [--sink 4] [--window 512]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import kakeya
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.corpus import read_text, split_sources, stdlib_sources
from lib.daemon import Daemon
from lib.niah import build_document
from lib.results import RESULTS_DIR, write_results

from inference_engine.config import BUNDLED_MODEL_DIR


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", help="a running daemon (default: start one serving --model)")
    p.add_argument(
        "--model",
        type=Path,
        default=BUNDLED_MODEL_DIR,
        help="model directory: its tokenizer, and the model the started daemon serves",
    )
    p.add_argument("--serve-flag", action="append", default=[], help="extra flag for the started daemon")
    p.add_argument("--lengths", default="512,1024,2048", help="comma-separated context lengths (tokens)")
    p.add_argument("--depths", type=int, default=5, help="needle depths from 0 (start) to 1 (end)")
    p.add_argument("--samples", type=int, default=20, help="documents per context length")
    p.add_argument("--kv-strategies", default="full,sink_window")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.kv_strategies = [s.strip() for s in args.kv_strategies.split(",")]
    if args.depths < 1 or args.samples < 1 or min(args.lengths) < 64:
        p.error("--depths and --samples must be >= 1, every length >= 64")
    return args


def heldout_lines(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Token ids of every line of the held-out corpus files (text the model never trained on)."""
    _, held = split_sources(stdlib_sources())
    lines = [line for path in held for line in read_text(path).splitlines(True)]
    return [ids for ids in tokenizer(lines, add_special_tokens=False)["input_ids"] if ids]


def run(args: argparse.Namespace, client: kakeya.Client, tokenizer: PreTrainedTokenizerBase) -> list[dict[str, Any]]:
    lines = heldout_lines(tokenizer)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    rng = random.Random(args.seed)
    depths = [i / (args.depths - 1) if args.depths > 1 else 0.5 for i in range(args.depths)]
    documents = [
        (length, depths[i % len(depths)], build_document(lines, encode, length, [depths[i % len(depths)]], rng))
        for length in args.lengths
        for i in range(args.samples)
    ]
    samples = []
    for strategy in args.kv_strategies:
        create: dict[str, Any] = {"kv_strategy": strategy}
        if strategy == "sink_window":
            create |= {"sink_tokens": args.sink, "window_tokens": args.window}
        for length, depth, doc in tqdm(documents, desc=f"niah {strategy}", unit="doc", file=sys.stderr):
            started = time.perf_counter()
            with client.create_session(initial_tokens=doc.prompt, label="eval-niah", **create) as session:
                tokens = list(session.generate(args.max_tokens))
                info = session.info()
            text = tokenizer.decode(tokens)
            samples.append(
                {
                    "kv_strategy": strategy,
                    "length": length,
                    "prompt_tokens": len(doc.prompt),
                    "depth": depth,
                    "key": doc.needles[0].key,
                    "value": doc.needles[0].value,
                    "output": text,
                    "recalled": doc.needles[0].value in text,
                    "seconds": time.perf_counter() - started,
                    "kv_live_bytes": info.kv_live_bytes,
                }
            )
    return samples


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    cells: dict[tuple[str, int, float], list[bool]] = defaultdict(list)
    rungs: dict[tuple[str, int], list[bool]] = defaultdict(list)
    for s in samples:
        cells[(s["kv_strategy"], s["length"], s["depth"])].append(s["recalled"])
        rungs[(s["kv_strategy"], s["length"])].append(s["recalled"])
    recall: dict[str, dict[str, float]] = defaultdict(dict)
    for (strategy, length), hits in sorted(rungs.items()):
        recall[strategy][str(length)] = sum(hits) / len(hits)
    by_depth: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for (strategy, length, depth), hits in sorted(cells.items()):
        by_depth[strategy][str(length)][f"{depth:.2f}"] = sum(hits) / len(hits)
    counts = {f"{strategy}/{length}": len(hits) for (strategy, length), hits in rungs.items()}
    return {
        "recall": dict(recall),
        "recall_by_depth": {k: dict(v) for k, v in by_depth.items()},
        "samples_per_rung": counts,
    }


def plot(summary: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = list(summary["recall_by_depth"])
    fig, axes = plt.subplots(1, len(strategies), figsize=(5 * len(strategies), 4), squeeze=False)
    for index, (ax, strategy) in enumerate(zip(axes[0], strategies, strict=True)):
        table = summary["recall_by_depth"][strategy]
        lengths = list(table)
        depths = sorted({d for row in table.values() for d in row}, key=float)
        grid = [[table[length].get(d, float("nan")) for length in lengths] for d in depths]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        ax.set_xticks(range(len(lengths)), lengths)
        ax.set_yticks(range(len(depths)), depths)
        ax.set(xlabel="context length (tokens)", title=f"recall, {strategy}")
        if index == 0:
            ax.set_ylabel("needle depth (0: start, 1: end)")
        for y, row in enumerate(grid):
            for x, value in enumerate(row):
                ax.text(x, y, f"{value:.2f}", ha="center", va="center", color="white" if value < 0.6 else "black")
    fig.colorbar(image, ax=axes[0].tolist())
    fig.savefig(png, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    daemon = None
    if args.address is None:
        daemon = Daemon(["--model", str(args.model), *args.serve_flag])
        args.address = daemon.wait_listening()
    try:
        with kakeya.Client(args.address, timeout_s=600.0) as client:
            client.wait_until_ready(60.0)
            samples = run(args, client, tokenizer)
    finally:
        if daemon is not None:
            daemon.stop()
    summary = summarize(samples)
    path = write_results(
        "eval_niah",
        config=vars(args),
        samples=samples,
        summary=summary,
        plot=lambda png: plot(summary, png),
        out_dir=args.results_dir,
        environment_extra={"daemon_command": daemon.command if daemon else None},
    )
    for strategy, rungs in summary["recall"].items():
        print(strategy, " ".join(f"{length}:{value:.2f}" for length, value in rungs.items()))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
