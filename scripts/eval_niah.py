"""Needle-in-a-haystack recall over the running daemon, through the Python SDK, for any KV strategy.

For every KV strategy (`--kv-strategies`, side by side in one run: each session picks its own strategy), every
context length of the ladder (`--lengths`) and every needle depth (`--depths`, spread from the start to the end
of the filler), it builds documents of that many tokens (`--documents`):
- `chat`: prose paragraphs of the Python reference manual (`pydoc_data`, which no training script reads) with the
  sentence `The secret code for KEY is VALUE.` as a paragraph at that depth, and the question in the same user
  turn, rendered with the model's chat template up to where the assistant answers;
- `code` (the default): held-out standard-library source with the line `# The secret code for KEY is VALUE.`
  inserted at that depth, ending with the question and the answer prefix `# Answer: the secret code for KEY is`
  (what a model without chat skills, like the bundled one, can answer).
Each document is one session created with it as initial history; the daemon generates `--max-tokens` greedy
tokens, and the sample recalls the needle when VALUE appears in their decoded text. `--samples` documents per rung
(context length) are spread evenly over the depths; the same documents are used for every strategy. A document
with its answer must fit the model's context: a rung at the context length itself (8,192 for SmolLM2) is asked
as that length less `--max-tokens`.

An arm of `--kv-strategies` is a strategy name, optionally with a restoration plan and a KV compressor:
`dlm_restore:recompute` (every evicted layer recomputed: the exact reference), `dlm_restore:model` (the plan the
model directory ships; the daemon's `recompute` when it ships none, with a note), `dlm_restore:PATH` (a plan
manifest); a plan may be followed by `+COMPRESSOR` (`dlm_restore:model+kakeya_d4`: the same plan with its kept
layers packed by that compressor, the resident K/V left dense), and any arm by `@kakeya_e8` or `@kakeya_d4` (the
session's compressor, which packs the resident K/V and a plan's kept layers). The restoration plan is a server
setting, so each plan gets its own started daemon (`--restore-plan`); with `--address` only arms without a plan run.

Writes `results/eval_niah_<stamp>.json` (per-sample outcomes, recall per arm x length x depth, and per arm x length
in `summary`: recall averaged over depths, sustained bytes per parked session, per-step peak bytes, restoration
state bytes per evicted position (the kept layers' K/V), the token ids a plan keeps per history position, and
generated tokens/s) and a heat-map PNG with one panel per arm.

Usage:
    python scripts/eval_niah.py [--address HOST:PORT] [--model NAME|DIR|GGUF] [--lengths 512,1024,2048] [--depths 5]
        [--samples 20] [--kv-strategies full,sink_window,dlm_restore:recompute,dlm_restore:model] [--sink 4]
        [--window 512] [--documents code|chat]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kakeya
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from inference_engine.model_dir_info import ModelDirInfo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.corpus import manual_sections, read_text, split_sources, stdlib_sources
from lib.daemon import Daemon
from lib.model_option import add_model_option
from lib.niah import build_chat_document, build_document
from lib.results import RESULTS_DIR, write_results

from kv_cache_proposer.restoration import RestorationPlan, find_plan


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", help="a running daemon (default: start one serving --model)")
    add_model_option(p, "the model whose tokenizer builds the documents and which the started daemon serves")
    p.add_argument("--serve-flag", action="append", default=[], help="extra flag for the started daemon")
    p.add_argument("--lengths", default="512,1024,2048", help="comma-separated context lengths (tokens)")
    p.add_argument("--depths", type=int, default=5, help="needle depths from 0 (start) to 1 (end)")
    p.add_argument("--samples", type=int, default=20, help="documents per context length")
    p.add_argument(
        "--kv-strategies",
        default="full,sink_window",
        help="comma-separated arms: strategy[:plan][@compressor] (default full,sink_window)",
    )
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=512)
    p.add_argument(
        "--max-tokens",
        type=int,
        help="greedy tokens generated per document (default: 10 for code, whose answer prefix already names the "
        "key; 32 for chat, where the model restates the question before the code)",
    )
    p.add_argument(
        "--documents",
        choices=("code", "chat"),
        default="code",
        help="code: source code with the question and an answer prefix at its end (default); chat: a prose document "
        "and the question in a user turn, in the model's chat template",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.kv_strategies = [s.strip() for s in args.kv_strategies.split(",")]
    if args.max_tokens is None:
        args.max_tokens = 32 if args.documents == "chat" else 10
    if args.depths < 1 or args.samples < 1 or min(args.lengths) < 64:
        p.error("--depths and --samples must be >= 1, every length >= 64")
    model_plans = {arm for arm in args.kv_strategies if arm_plan(arm).partition("+")[0] == "model"}
    if model_plans and args.address is None and find_plan(args.model) is None:
        if any("+" in arm_plan(arm) for arm in model_plans):
            p.error(f"{args.model_name} ships no restoration plan to pack: leave out the model+COMPRESSOR arms")
        print(f"note: {args.model_name} ships no restoration plan: dlm_restore:model runs recompute", file=sys.stderr)
    return args


def arm_plan(arm: str) -> str:
    """The plan part of an arm (`model`, `recompute`, a path, maybe with `+COMPRESSOR`; empty: none)."""
    return arm.partition("@")[0].partition(":")[2]


def heldout_lines(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Token ids of every line of the held-out corpus files (text the model never trained on)."""
    _, held = split_sources(stdlib_sources())
    lines = [line for path in held for line in read_text(path).splitlines(True)]
    return [ids for ids in tokenizer(lines, add_special_tokens=False)["input_ids"] if ids]


def arm_settings(arm: str, sink: int, window: int) -> tuple[str | None, dict[str, Any]]:
    """An arm's restoration plan (the daemon's `--restore-plan`; None: the daemon's default) and session options."""
    rest, _, compressor = arm.partition("@")
    strategy, _, plan = rest.partition(":")
    create: dict[str, Any] = {"kv_strategy": strategy}
    if strategy in ("sink_window", "dlm_restore"):
        create |= {"sink_tokens": sink, "window_tokens": window}
    if compressor:
        create["kv_compressor"] = compressor
    return (None if plan in ("", "model") else plan), create


def plan_manifest(plan: str, model: Path, scratch: Path) -> str:
    """The manifest `--restore-plan` gets for an arm's plan: `recompute`, a path, or `model`/a path followed by
    `+COMPRESSOR`, written under `scratch` as that plan with its kept layers packed by COMPRESSOR."""
    base, _, compressor = plan.partition("+")
    if not compressor:
        return plan
    source = RestorationPlan.load(model if base == "model" else Path(base))
    target = scratch / f"{len(list(scratch.iterdir()))}" / "restore_plan.json"
    return str(source.with_kept_compressor(compressor).save(target))


@dataclass(frozen=True, slots=True)
class Probe:
    """One needle document of a rung: its prompt and the fact it asks for."""

    length: int
    depth: float
    prompt: list[int]
    key: str
    value: str


def documents_for(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> list[Probe]:
    """The needle documents of every rung, the same for every arm."""
    rng = random.Random(args.seed)
    depths = [i / (args.depths - 1) if args.depths > 1 else 0.5 for i in range(args.depths)]
    context = ModelDirInfo.read(Path(args.model)).trained_context_tokens
    sizes = {length: min(length, context - args.max_tokens) if context else length for length in args.lengths}
    probes = []
    if args.documents == "chat":
        filler = [text for _, text in manual_sections()]
        for length, size in sizes.items():
            for i in range(args.samples):
                chat = build_chat_document(tokenizer, filler, size, depths[i % len(depths)], rng)
                probes.append(Probe(length, chat.depth, chat.prompt, chat.key, chat.value))
        return probes
    lines = heldout_lines(tokenizer)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    for length, size in sizes.items():
        for i in range(args.samples):
            doc = build_document(lines, encode, size, [depths[i % len(depths)]], rng)
            probes.append(Probe(length, doc.depths[0], doc.prompt, doc.needles[0].key, doc.needles[0].value))
    return probes


def run_arm(
    args: argparse.Namespace,
    arm: str,
    client: kakeya.Client,
    tokenizer: PreTrainedTokenizerBase,
    documents: list[Probe],
) -> list[dict[str, Any]]:
    _, create = arm_settings(arm, args.sink, args.window)
    samples = []
    for doc in tqdm(documents, desc=f"niah {arm}", unit="doc", file=sys.stderr):
        started = time.perf_counter()
        with client.create_session(initial_tokens=doc.prompt, label="eval-niah", **create) as session:
            generation = session.generate(args.max_tokens)
            tokens = list(generation)
            generate_s = time.perf_counter() - started
            info = session.info()
        text = tokenizer.decode(tokens)
        samples.append(
            {
                "kv_strategy": arm,
                "length": doc.length,
                "prompt_tokens": len(doc.prompt),
                "depth": doc.depth,
                "key": doc.key,
                "value": doc.value,
                "output": text,
                "recalled": doc.value in text,
                "seconds": time.perf_counter() - started,
                "tokens_per_s": len(tokens) / generate_s,
                "kv_live_bytes": info.kv_live_bytes,  # parked: what the session holds between generations
                "peak_bytes": info.kv_live_bytes + info.kv_peak_restored_bytes,
                "restoration_state_bytes": info.kv_restoration_state_bytes,
                "history_token_bytes": info.history_token_bytes,
                "committed_tokens": info.history_length - info.pending_token_count,
                "evicted_tokens": info.evicted_token_count,
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
    costs: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for strategy, length in sorted(rungs):
        rung = [s for s in samples if s["kv_strategy"] == strategy and s["length"] == length]
        evicted = sum(s.get("evicted_tokens", 0) for s in rung)
        costs[strategy][str(length)] = {
            "sustained_bytes": sum(s["kv_live_bytes"] for s in rung) / len(rung),
            "peak_bytes": sum(s.get("peak_bytes", s["kv_live_bytes"]) for s in rung) / len(rung),
            "restoration_state_bytes_per_evicted_token": (
                sum(s.get("restoration_state_bytes", 0) for s in rung) / evicted if evicted else 0.0
            ),
            "history_token_bytes_per_token": (
                sum(s.get("history_token_bytes", 0) for s in rung)
                / max(1, sum(s.get("committed_tokens", s["prompt_tokens"]) for s in rung))
            ),
            "tokens_per_s": sum(s.get("tokens_per_s", 0.0) for s in rung) / len(rung),
        }
    return {
        "recall": dict(recall),
        "recall_by_depth": {k: dict(v) for k, v in by_depth.items()},
        "cost": dict(costs),
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
    if args.documents == "chat" and not getattr(tokenizer, "chat_template", None):
        raise SystemExit(f"{args.model_name} has no chat template: chat documents need one")
    documents = documents_for(args, tokenizer)
    by_plan: dict[str | None, list[str]] = defaultdict(list)
    for arm in args.kv_strategies:
        by_plan[arm_settings(arm, args.sink, args.window)[0]].append(arm)
    if args.address is not None and set(by_plan) != {None}:
        raise SystemExit("arms with a restoration plan start their own daemons: leave out --address")
    samples: list[dict[str, Any]] = []
    commands = []
    derived = tempfile.TemporaryDirectory(prefix="eval-niah-plans-")
    for plan, arms in by_plan.items():
        daemon, address = None, args.address
        if address is None:
            plan_flags = [] if plan is None else ["--restore-plan", plan_manifest(plan, args.model, Path(derived.name))]
            daemon = Daemon(["--model", str(args.model), *plan_flags, *args.serve_flag])
            address = daemon.wait_listening()
            commands.append(daemon.command)
        try:
            with kakeya.Client(address, timeout_s=600.0) as client:
                client.wait_until_ready(60.0)
                for arm in arms:
                    samples += run_arm(args, arm, client, tokenizer, documents)
        finally:
            if daemon is not None:
                daemon.stop()
    derived.cleanup()
    summary = summarize(samples)
    path = write_results(
        "eval_niah",
        config=vars(args),
        samples=samples,
        summary=summary,
        plot=lambda png: plot(summary, png),
        out_dir=args.results_dir,
        environment_extra={"daemon_commands": commands},
    )
    for strategy, rungs in summary["recall"].items():
        print(strategy, " ".join(f"{length}:{value:.2f}" for length, value in rungs.items()))
        cost = summary["cost"][strategy]
        print("  sustained bytes", " ".join(f"{length}:{c['sustained_bytes']:.0f}" for length, c in cost.items()))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
