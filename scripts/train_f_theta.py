"""Fit the f_θ maps of a restoration plan: a linear map per `projected` layer from the kept layer it reads, or
from the DFlash drafter's context state (`projected<-drafter`).

The plan comes from `--plan`: a manifest (JSON, e.g. one `plan_restore.py` wrote) or a compact spec such as
`tokens,projected<-3,projected<-3,kept` (see `kv_cache_proposer.restoration.plan.plan_from_spec`). The script runs
the verifier with full attention over `--texts` sequences of `--length` tokens of the training corpus (the standard
library's source, held-out files excluded), collects every layer's K/V per position (and, for `projected<-drafter`
layers, the context row the drafter of `--drafter` computes from the verifier's features) and fits each map by
closed-form ridge least squares (`--ridge`), reporting its relative error (on the K/V as stored) on the last 10 %
of the rows. By default (`--key-frame stored`) a map reads and writes keys as the cache stores them, turned by
their positions' rotary angles; with `--key-frame unrotated` (a verifier with rotary position embeddings over
whole heads) it works in the keys' unrotated frame: source keys are turned back from their positions before it
and the keys it writes are turned to theirs after it, so a row without a position (the drafter's context) can
predict a key at all. The rows
are saved to `--rows-cache` when given and read back from it on a later run (a rerun with another `--ridge` skips
the forwards). The fitted plan is written to `--out` (default: the model directory's `restore_plan.json`, with its
safetensors next to it), and a log to `results/train_f_theta_<stamp>.json` with a bar plot of the fit errors.

With `--distill-steps N`, each map is then trained further, by gradient descent from its least-squares fit, on
what attention reads of it: the output of its layer's attention for the training texts' queries over the resident
K/V (`--sink` + `--window`, exact) and the restored ones (`lib/distill.py`; the last text is held out, and a map
that does no better there keeps its least-squares weights). No next-token (logit) distillation.

Usage:
    python scripts/train_f_theta.py [--model NAME|DIR|GGUF] --plan SPEC|MANIFEST [--texts 24] [--length 1024]
        [--ridge 1e-3] [--out PATH] [--rows-cache PATH] [--seed 0] [--drafter DIR] [--key-frame unrotated|stored]
        [--distill-steps 0] [--distill-lr 1e-2] [--sink 4] [--window 256]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import cache, partial
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.distill import DistillSettings, add_distill_options, distill_plan
from lib.model_option import add_model_option
from lib.restoration import (
    DRAFTER_ROWS,
    POSITIONS,
    add_key_frame_option,
    fit_projections,
    key_frame_rotary,
    kv_rows_by_layer,
    least_squares_method,
    token_stream,
)
from lib.results import RESULTS_DIR, write_results

from kv_cache_proposer.backends import load_verifier
from kv_cache_proposer.restoration import PLAN_FILE, RestorationPlan
from kv_cache_proposer.restoration.drafter_context import DrafterContext
from kv_cache_proposer.restoration.plan import plan_from_spec


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(p, "the verifier")
    p.add_argument("--plan", required=True, help="restoration plan: a manifest path or a per-layer spec")
    p.add_argument("--texts", type=int, default=24, help="training sequences (default 24)")
    p.add_argument("--length", type=int, default=1024, help="tokens per training sequence (default 1024)")
    p.add_argument("--ridge", type=float, default=1e-3, help="ridge strength, relative to the feature variance")
    p.add_argument("--out", type=Path, help="where to write the fitted plan (default: <model>/restore_plan.json)")
    p.add_argument("--rows-cache", type=Path, help="npz of collected K/V rows: read when present, else written")
    p.add_argument("--seed", type=int, default=0, help="seed of the training-text sampling (default 0)")
    p.add_argument(
        "--drafter",
        type=Path,
        help="DFlash drafter whose context `projected<-drafter` layers read (default: <model>/dflash)",
    )
    add_key_frame_option(p)
    add_distill_options(p)
    p.add_argument("--sink", type=int, default=4, help="sink positions the plan is distilled for (default 4)")
    p.add_argument("--window", type=int, default=256, help="window positions it is distilled for (default 256)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the log goes (default results/)")
    args = p.parse_args(argv)
    if args.texts < 1 or args.length < 2 or args.ridge < 0:
        p.error("--texts must be >= 1, --length >= 2 and --ridge >= 0")
    if args.distill_steps < 0 or (args.distill_steps and args.texts < 2):
        p.error("--distill-steps must be >= 0, and distillation needs --texts >= 2 (the last is held out)")
    if args.distill_steps and args.length <= args.sink + args.window + 1:
        p.error(f"--length {args.length} evicts nothing under --sink {args.sink} + --window {args.window}")
    return args


def drafter_context(directory: Path | None, model: Path) -> DrafterContext | None:
    """The context of the drafter in `directory` (default: the model's bundled `dflash/`), if there is one."""
    path = directory or model / "dflash"
    return DrafterContext.from_drafter(path) if (path / "config.json").is_file() else None


def load_plan(spec: str, num_layers: int, drafter: DrafterContext | None = None) -> RestorationPlan:
    """A manifest path, or a compact spec."""
    if spec.endswith(".json") or Path(spec).is_dir():
        return RestorationPlan.load(spec)
    return plan_from_spec(spec, num_layers, drafter)


def _row_key(layer: int) -> str:
    return {DRAFTER_ROWS: "drafter", POSITIONS: "positions"}.get(layer, f"layer{layer}")


def training_texts(args: argparse.Namespace) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    return token_stream(tokenizer, args.texts, args.length, random.Random(args.seed), held_out=False)


def collect_rows(
    args: argparse.Namespace,
    verifier: Any,
    layers: list[int],
    texts: Callable[[], list[list[int]]],
    drafter: DrafterContext | None = None,
) -> dict[int, np.ndarray]:
    """The K/V rows of `layers` (and the drafter's context rows) of the training `texts`, from `--rows-cache`
    when it holds them all (the texts are then not read)."""
    wanted = [*layers, POSITIONS, *([DRAFTER_ROWS] if drafter is not None else [])]
    if args.rows_cache is not None and args.rows_cache.exists():
        stored = np.load(args.rows_cache)
        if all(_row_key(layer) in stored for layer in wanted):
            print(f"read K/V rows from {args.rows_cache}", file=sys.stderr)
            return {layer: stored[_row_key(layer)] for layer in wanted}
    rows = kv_rows_by_layer(verifier, texts(), layers, drafter)
    if args.rows_cache is not None:
        args.rows_cache.parent.mkdir(parents=True, exist_ok=True)
        np.savez(args.rows_cache, **{_row_key(layer): r for layer, r in rows.items()})  # type: ignore[arg-type]
    return rows


def plot(errors: dict[str, float], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(errors)), 3.5))
    names = list(errors)
    ax.bar(names, [errors[n] for n in names], color="tab:blue")
    ax.set(ylabel="held-out relative error", title="f_θ fit (closed-form least squares)")
    fig.savefig(png, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    verifier = load_verifier("torch", args.model, device="cpu", dtype="float32")
    plan = load_plan(args.plan, verifier.num_layers, drafter_context(args.drafter, args.model))
    plan.check_model(verifier.num_layers)
    pairs = [(source.from_layer, index) for index, source in enumerate(plan.layers) if source.from_layer is not None]
    projected = [index for index, source in enumerate(plan.layers) if source.kind == "projected"]
    if not projected:
        print("the plan has no projected layer: nothing to fit", file=sys.stderr)
        return 2
    started = time.perf_counter()
    layers = sorted({layer for pair in pairs for layer in pair} | set(projected))
    texts = cache(partial(training_texts, args))  # read once, and only when the rows or distillation need them
    rows = collect_rows(args, verifier, layers, texts, plan.drafter if plan.uses_drafter else None)
    rotary = key_frame_rotary(args, verifier)
    fitted, errors = fit_projections(plan, rows, ridge=args.ridge, rotary=rotary)
    method = least_squares_method(args.ridge, rotary)
    attention: dict[str, dict[str, float]] = {}
    if args.distill_steps:
        settings = DistillSettings.from_args(args)
        fitted, attention = distill_plan(verifier, fitted, rows, texts(), settings)
        method += f", then {settings.describe()}"
    notes = {**fitted.notes, "f_theta": method, "fit_error": errors}
    if attention:
        notes["attention_output_error"] = attention
    fitted = replace(fitted, verifier=args.model.name, notes=notes)
    out = fitted.save(args.out or args.model / PLAN_FILE)
    summary = {
        "plan": fitted.describe(),
        "kept_fraction": fitted.kept_fraction,
        "fit_relative_error": errors,
        "attention_output_error": attention,
        "rows": int(next(iter(rows.values())).shape[0]),
        "seconds": time.perf_counter() - started,
        "manifest": str(out),
    }
    path = write_results(
        "train_f_theta",
        config=vars(args),
        samples=[{"map": name, "relative_error": value} for name, value in errors.items()],
        summary=summary,
        plot=lambda png: plot(errors, png),
        out_dir=args.results_dir,
    )
    for name, value in errors.items():
        print(f"{name}: held-out relative error {value:.4f}")
    for name, pair in attention.items():
        print(f"{name}: attention output error {pair['least_squares']:.4f} -> {pair['distilled']:.4f} (held out)")
    print(f"wrote {out} and {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
