"""Find a restoration plan for a model: per-layer sensitivity, then the cheapest plan under a byte budget.

First, which layers a `tokens` source rebuilds exactly: a layer qualifies when its K/V of a stretch of held-out
text computed from that stretch alone equal (to 1e-4 relative) those computed after the whole text before it.

Sensitivity: starting from the exact plan that keeps every layer's K/V, each layer in turn is restored from one
candidate source while every other layer stays exact, and the script measures needle recall (greedy decoding of
needle documents under `dlm_restore` with `--sink` + `--window`; `--documents chat`: prose with the question in a
user turn, in the model's chat template) and the mean KL divergence of the next-token
distributions from `full` on held-out text. Candidate sources (`--sources`): `projected<-J` for every other layer J
(`layers`), and `projected<-drafter`, f_θ from the context state of the DFlash drafter of `--drafter` (`drafter`;
default drafter: the model's `dflash/`, which not every model ships), each a linear f_θ fitted by closed-form least
squares on training text, as `train_f_theta.py` does (keys as stored, or in their unrotated frame with
`--key-frame unrotated`); `tokens` is exact where it applies and not tried elsewhere.

Proposal: a layer tolerates a source when its recall is within `--recall-tolerance` of `full` and its KL is at
most `--max-kl`. Over sets of kept layers, cheapest first, every other layer takes a tolerated source (`tokens`
first, else the projection with the lowest KL from a kept layer or the drafter); the first combination whose own
measured recall is within the tolerance at every length and whose state bytes (kept K/V, plus the drafter's
context row when a layer reads it) fit `--budget` (a fraction of the full K/V bytes of an evicted position) is
written to `--out` (default: `<model>/restore_plan.json`) with its f_θ weights. `--plans` skips the search: it
fits and measures the named plans (compact specs, `;`-separated) and writes none; with `--distill-steps`, their
maps are then trained on their layers' attention output, as `train_f_theta.py --distill-steps` does. The log
(`results/plan_restore_<stamp>.json`, with a heat map of the sensitivities) holds every measurement.

Usage:
    python scripts/plan_restore.py [--model NAME|DIR|GGUF] [--budget 0.25] [--lengths 1024,2048] [--samples 5]
        [--sink 4] [--window 256] [--recall-tolerance 0.05] [--max-kl 0.05] [--out PATH] [--dry-run]
        [--sources layers|drafter|all] [--drafter DIR] [--documents code|chat] [--key-frame unrotated|stored]
        [--plans SPEC;SPEC... [--distill-steps 0] [--distill-lr 1e-2]]
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.distill import DistillSettings, add_distill_options, distill_plan
from lib.model_option import add_model_option
from lib.restoration import (
    add_key_frame_option,
    fit_projections,
    key_frame_rotary,
    kv_rows_by_layer,
    least_squares_method,
    logit_divergence,
    make_probe,
    recall,
    token_only_layers,
    token_stream,
)
from lib.results import RESULTS_DIR, write_results

from kv_cache_proposer.backends import load_verifier
from kv_cache_proposer.restoration import PLAN_FILE, LayerSource, LinearProjection, RestorationPlan, Rotary
from kv_cache_proposer.restoration.drafter_context import DrafterContext
from kv_cache_proposer.restoration.plan import plan_from_spec


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(p, "the verifier")
    p.add_argument("--budget", type=float, default=0.25, help="kept bytes per evicted position / full (default 0.25)")
    p.add_argument("--lengths", default="1024,2048", help="needle context lengths (default 1024,2048)")
    p.add_argument("--samples", type=int, default=5, help="needle documents per length (default 5)")
    p.add_argument("--texts", type=int, default=2, help="held-out texts for the KL measurement (default 2)")
    p.add_argument("--train-texts", type=int, default=16, help="training texts for f_θ (default 16)")
    p.add_argument("--train-length", type=int, default=1024, help="tokens per training text (default 1024)")
    p.add_argument("--ridge", type=float, default=1e-3, help="f_θ ridge strength (default 1e-3)")
    p.add_argument("--sink", type=int, default=4, help="resident sink positions (default 4)")
    p.add_argument("--window", type=int, default=256, help="resident window positions (default 256)")
    p.add_argument("--recall-tolerance", type=float, default=0.05, help="allowed recall drop (default 0.05)")
    p.add_argument("--max-kl", type=float, default=0.05, help="allowed mean KL from full, nats (default 0.05)")
    p.add_argument("--seed", type=int, default=7, help="seed of the probe documents (default 7)")
    p.add_argument(
        "--documents",
        choices=("code", "chat"),
        default="code",
        help="needle documents: code (source code with the question and an answer prefix at its end; default) or "
        "chat (prose with the question in a user turn, in the model's chat template)",
    )
    p.add_argument("--out", type=Path, help="where to write the plan (default: <model>/restore_plan.json)")
    p.add_argument("--dry-run", action="store_true", help="measure and log, but write no plan")
    p.add_argument(
        "--sources",
        choices=("layers", "drafter", "all"),
        default="layers",
        help="f_θ sources to measure: other layers' kept K/V, the drafter's context, or both (default layers)",
    )
    p.add_argument("--drafter", type=Path, help="DFlash drafter for `drafter` sources (default: <model>/dflash)")
    add_key_frame_option(p)
    add_distill_options(p)
    p.add_argument(
        "--plans",
        help="measure these plans only (compact specs such as `tokens,projected<-drafter,kept`, `;`-separated): no "
        "per-layer sweep, no proposal, no plan written",
    )
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the log goes (default results/)")
    args = p.parse_args(argv)
    if args.distill_steps and not args.plans:
        p.error("--distill-steps trains the maps of the plans --plans names (the per-layer sweep fits least squares)")
    if args.distill_steps and args.train_texts < 2:
        p.error("distillation needs --train-texts >= 2 (the last is held out)")
    args.lengths = [int(x) for x in args.lengths.split(",")]
    if args.samples < 1 or args.texts < 1 or not 0 < args.budget <= 1:
        p.error("--samples and --texts must be >= 1, --budget in (0, 1]")
    args.drafter = args.drafter or args.model / "dflash"
    # A drafter is read for drafter sources, swept or named in a plan.
    args.reads_drafter = args.sources != "layers" or "drafter" in (args.plans or "")
    if args.reads_drafter and not (args.drafter / "config.json").is_file():
        p.error(
            f"--sources {args.sources} reads a DFlash drafter: there is none at {args.drafter} "
            "(name one with --drafter)"
        )
    return args


DRAFTER_SOURCE = "projected<-drafter"


def state_fraction(plan: RestorationPlan, row_width: int) -> float:
    """State bytes per evicted position over the full K/V bytes of a position: kept layers, plus the drafter's
    context row when a layer reads it (`row_width`: K/V values of one layer per position)."""
    drafter = plan.drafter.width if plan.drafter is not None and plan.uses_drafter else 0
    return plan.kept_fraction + drafter / (row_width * len(plan.layers))


def measure(verifier: Any, plan: RestorationPlan, probe: Any, desc: str, row_width: int) -> dict[str, Any]:
    return {
        "plan": plan.describe(),
        "recall": recall(verifier, plan, probe, desc=desc),
        "kl": logit_divergence(verifier, plan, probe),
        "kept_fraction": plan.kept_fraction,
        "state_fraction": state_fraction(plan, row_width),
    }


def candidate_plans(
    num_layers: int, kept: tuple[int, ...], tolerated: dict[int, list[str]], drafter: DrafterContext | None = None
) -> RestorationPlan | None:
    """The plan keeping exactly `kept`, every other layer from its best tolerated source reachable from them."""
    layers = []
    for layer in range(num_layers):
        if layer in kept:
            layers.append(LayerSource("kept"))
            continue
        choice = next(
            (
                s
                for s in tolerated[layer]
                if s == "tokens"
                or (s == DRAFTER_SOURCE and drafter is not None)
                or s.partition("<-")[2] in map(str, kept)
            ),
            None,
        )
        if choice is None:
            return None
        if choice == "tokens":
            layers.append(LayerSource("tokens"))
        elif choice == DRAFTER_SOURCE:
            layers.append(LayerSource("projected", projection=_placeholder(drafter), from_drafter=True))
        else:
            layers.append(LayerSource("projected", from_layer=int(choice.partition("<-")[2])))
    uses_drafter = any(source.from_drafter for source in layers)
    return RestorationPlan(tuple(layers), drafter=drafter if uses_drafter else None)


def _placeholder(drafter: DrafterContext | None) -> LinearProjection:
    """A zero f_θ from the drafter context, replaced by the fitted one."""
    assert drafter is not None  # chosen only when a drafter is given
    return LinearProjection(np.zeros((drafter.width, 1), np.float32), np.zeros(1, np.float32))


def plot(sensitivity: list[dict[str, Any]], num_layers: int, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = sorted({row["source"] for row in sensitivity})
    grid = np.full((len(sources), num_layers), np.nan)
    for row in sensitivity:
        grid[sources.index(row["source"]), row["layer"]] = row["recall"]
    fig, ax = plt.subplots(figsize=(1.4 * num_layers + 2, 0.5 * len(sources) + 2))
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(num_layers), [f"L{i}" for i in range(num_layers)])
    ax.set_yticks(range(len(sources)), sources)
    ax.set(xlabel="layer restored from the source (others exact)", title="needle recall per layer and source")
    for y, x in itertools.product(range(len(sources)), range(num_layers)):
        if not np.isnan(grid[y, x]):
            ax.text(x, y, f"{grid[y, x]:.2f}", ha="center", va="center", color="white" if grid[y, x] < 0.6 else "k")
    fig.colorbar(image, ax=ax)
    fig.savefig(png, dpi=120, bbox_inches="tight")
    plt.close(fig)


def measure_named(
    args: argparse.Namespace,
    verifier: Any,
    probe: Any,
    training: tuple[list[list[int]], dict[int, np.ndarray]],
    rotary: Rotary | None,
    drafter: DrafterContext | None,
    full_recall: float,
    started: float,
) -> int:
    """`--plans`: fit (and, with `--distill-steps`, distil) and measure each named plan from the training `texts`
    and their `rows`; log them as `combined` and write no plan."""
    texts, rows = training
    row_width = int(rows[0].shape[1])
    measured = []
    for spec in args.plans.split(";"):
        plan, errors = fit_projections(
            plan_from_spec(spec, verifier.num_layers, drafter), rows, ridge=args.ridge, rotary=rotary
        )
        attention: dict[str, dict[str, float]] = {}
        if args.distill_steps:
            plan, attention = distill_plan(verifier, plan, rows, texts, DistillSettings.from_args(args))
        result = {
            **measure(verifier, plan, probe, f"plan {spec[:40]}", row_width),
            "fit_relative_error": errors,
            "attention_output_error": attention,
        }
        measured.append(result)
        print(f"{plan.describe()}: recall {result['recall']:.2f} (full {full_recall:.2f}), KL {result['kl']:.4f}")
    summary = {"full_recall": full_recall, "proposal": None, "seconds": time.perf_counter() - started}
    path = write_results(
        "plan_restore",
        config=vars(args),
        samples={"sensitivity": [], "combined": measured},
        summary=summary,
        plot=lambda png: plot_named(measured, full_recall, png),
        out_dir=args.results_dir,
    )
    print(f"wrote {path}")
    return 0


def plot_named(measured: list[dict[str, Any]], full_recall: float, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 0.6 * len(measured) + 2))
    names = [f"plan {i} ({row['state_fraction']:.0%} state)" for i, row in enumerate(measured)]
    left.barh(names, [row["recall"] for row in measured], color="tab:blue")
    left.axvline(full_recall, color="k", linestyle="--", label="full")
    left.set(xlabel="needle recall", xlim=(0, 1))
    left.legend()
    right.barh(names, [row["kl"] for row in measured], color="tab:orange")
    right.set(xlabel="mean KL from full (nats)")
    right.set_yticks([])
    fig.savefig(png, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    verifier = load_verifier("torch", args.model, device="cpu", dtype="float32")
    layers = verifier.num_layers
    probe = make_probe(
        tokenizer,
        lengths=args.lengths,
        samples=args.samples,
        texts=args.texts,
        sink=args.sink,
        window=args.window,
        seed=args.seed,
        chat=args.documents == "chat",
    )
    drafter = DrafterContext.from_drafter(args.drafter) if args.reads_drafter else None
    train = token_stream(tokenizer, args.train_texts, args.train_length, random.Random(args.seed), held_out=False)
    rows = kv_rows_by_layer(verifier, train, range(layers), drafter)
    rotary = key_frame_rotary(args, verifier)
    row_width = int(rows[0].shape[1])
    token_layers = token_only_layers(verifier, probe.texts[0][: 2 * args.window], start=args.window)
    print(f"layers rebuilt exactly from tokens: {token_layers}", file=sys.stderr)
    full_recall = recall(verifier, None, probe, desc="full")
    if args.plans:
        return measure_named(args, verifier, probe, (train, rows), rotary, drafter, full_recall, started)
    exact = RestorationPlan.uniform(layers, "kept")

    sensitivity: list[dict[str, Any]] = []
    tolerated: dict[int, list[tuple[float, str]]] = {layer: [] for layer in range(layers)}
    fit_errors: dict[str, float] = {}
    for layer in range(layers):
        if layer in token_layers:
            tolerated[layer].append((-1.0, "tokens"))  # exact and free: nothing to measure
            continue
        sources = [f"projected<-{j}" for j in range(layers) if j != layer] if args.sources != "drafter" else []
        sources += [DRAFTER_SOURCE] if drafter is not None else []
        for source in sources:
            if source == DRAFTER_SOURCE:
                replaced = LayerSource("projected", projection=_placeholder(drafter), from_drafter=True)
            else:
                replaced = LayerSource("projected", from_layer=int(source.partition("<-")[2]))
            plan = RestorationPlan(
                tuple(replaced if i == layer else s for i, s in enumerate(exact.layers)),
                drafter=drafter if replaced.from_drafter else None,
            )
            plan, errors = fit_projections(plan, rows, ridge=args.ridge, rotary=rotary)
            fit_errors.update(errors)
            row = {
                "layer": layer,
                "source": source,
                **measure(verifier, plan, probe, f"L{layer} {source}", row_width),
            }
            sensitivity.append(row)
            print(f"L{layer} <- {source}: recall {row['recall']:.2f}, KL {row['kl']:.4f}", file=sys.stderr)
            if full_recall - row["recall"] <= args.recall_tolerance and row["kl"] <= args.max_kl:
                tolerated[layer].append((row["kl"], source))
    ranked = {layer: [s for _, s in sorted(options)] for layer, options in tolerated.items()}

    proposal: dict[str, Any] | None = None
    tried: list[dict[str, Any]] = []
    for size in range(0, layers + 1):
        if size / layers > args.budget + 1e-9:
            break
        # A layer rebuilt exactly from tokens is never worth keeping.
        for kept in itertools.combinations([i for i in range(layers) if i not in token_layers], size):
            candidate = candidate_plans(layers, kept, ranked, drafter)
            if candidate is None or state_fraction(candidate, row_width) > args.budget + 1e-9:
                continue
            candidate, _ = fit_projections(candidate, rows, ridge=args.ridge, rotary=rotary)
            result = measure(verifier, candidate, probe, f"plan {candidate.describe()}", row_width)
            tried.append(result)
            if full_recall - result["recall"] <= args.recall_tolerance:
                proposal = {**result, "plan": candidate, "describe": candidate.describe()}
                break
        if proposal is not None:
            break

    written = None
    if proposal is not None and not args.dry_run:
        plan = proposal["plan"]
        _, errors = fit_projections(plan, rows, ridge=args.ridge, rotary=rotary)
        plan = replace(
            plan,
            verifier=args.model.name,
            notes={
                "found_by": "scripts/plan_restore.py",
                "sink": args.sink,
                "window": args.window,
                "recall": proposal["recall"],
                "full_recall": full_recall,
                "kl": proposal["kl"],
                "f_theta": least_squares_method(args.ridge, rotary),
                "fit_error": errors,
            },
        )
        written = str(plan.save(args.out or args.model / PLAN_FILE))
    summary = {
        "full_recall": full_recall,
        "token_only_layers": token_layers,
        "proposal": None if proposal is None else {k: v for k, v in proposal.items() if k != "plan"},
        "budget": args.budget,
        "tolerated": ranked,
        "fit_relative_error": fit_errors,
        "manifest": written,
        "seconds": time.perf_counter() - started,
    }
    path = write_results(
        "plan_restore",
        config=vars(args),
        samples={"sensitivity": sensitivity, "combined": tried},
        summary=summary,
        plot=lambda png: plot(sensitivity, layers, png),
        out_dir=args.results_dir,
    )
    if proposal is None:
        print(f"no plan within a budget of {args.budget:.2f} keeps recall within the tolerance; see {path}")
        return 1
    print(f"proposed {proposal['plan'].describe()}: recall {proposal['recall']:.2f} (full {full_recall:.2f})")
    print(f"wrote {written or '(dry run: no plan)'} and {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
