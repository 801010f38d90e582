"""Structured output side by side: tokens/s of JSON-schema-constrained generation vs unconstrained, with the
proposer `none` and with a speculative proposer, in one run on the same prompts, plus the grammar's own cost.

Four arms decode every prompt greedily, round-robin per prompt and repeat so machine noise hits all of them alike:
`none` and `<proposer>` (default ngram, kakeya-tiny's fastest proposer in bench_speculative), each
unconstrained and constrained by a tool-call JSON schema. Constrained outputs with the proposer must equal those
without it. The grammar's per-token cost is measured apart from the model: every constrained output is replayed
through a fresh grammar state (mask computation + advance per token), timed per token.

Usage:
    python scripts/bench_structured.py [--model NAME|DIR|GGUF] [--proposer ngram|dflash|draft_model] [--draft-model DIR]
        [--prompts 6] [--max-tokens 64] [--repeats 2] [--threads 0] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.model_option import add_model_option
from lib.results import RESULTS_DIR, write_results

from inference_engine.model_dir_info import model_drafter
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.controls import DecodeControls
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.grammar import GrammarCompiler, GrammarKind, GrammarSpec
from kv_cache_proposer.proposers import PROPOSERS, ProposerOptions, load_proposer
from kv_cache_proposer.proposers.base import Proposer
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy

SCHEMA = {
    "type": "object",
    "properties": {
        "tool": {"enum": ["search", "add", "weather"]},
        "arguments": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 24},
                "count": {"type": "integer", "minimum": 0, "maximum": 100},
            },
            "required": ["query", "count"],
            "additionalProperties": False,
        },
    },
    "required": ["tool", "arguments"],
    "additionalProperties": False,
}
PROMPTS = [
    "def add(a, b):\n    return a + b\n\n# call a tool for: ",
    "import os\nimport sys\n\nclass Config:\n    '''Settings.'''\n",
    "Reply with a JSON tool call.\nUser: find the weather in Paris\nCall: ",
    "for item in items:\n    if item is None:\n        continue\n",
    "Tools: search, add, weather.\nQuestion: how many files are there?\nAnswer: ",
    "    def __init__(self, name):\n        self.name = name\n",
    "# TODO: count the lines of every module\nresult = ",
    "Call the add tool with 2 and 3: ",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(p, "the verifier (its tokenizer.json too)")
    p.add_argument("--proposer", default="ngram", choices=[n for n in PROPOSERS if n != "none"])
    p.add_argument("--draft-model", type=Path, help="draft_model / dflash directory (dflash: the model's own)")
    p.add_argument("--prompts", type=int, default=6, help=f"prompts used, at most {len(PROMPTS)}")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    if args.proposer == "dflash" and args.draft_model is None and model_drafter(args.model) is None:
        p.error(f"--proposer dflash: {args.model_name} ships no DFlash drafter (dflash/); name one with --draft-model")
    return args


def decode(
    verifier: TorchVerifier, proposer: Proposer, prompt: list[int], args: argparse.Namespace, controls: Any
) -> dict[str, Any]:
    """Greedy decoding after `prompt`; the clock covers prefill, decode and (when constrained) the grammar.

    The first step prefills the prompt; it is timed apart so that decode speed compares arms whose outputs differ
    in length (a constrained output ends when its grammar completes)."""
    decoder = Decoder(verifier, burst_tokens=1)  # one forward per step in every arm, counted alike
    strategy = FullStrategy()
    seq = SequenceState(cache=verifier.new_cache(strategy), tokens=list(prompt), draft_session=proposer.open(strategy))
    stops = controls.eos if controls is not None else frozenset()
    budget = GenerationBudget(max_new_tokens=args.max_tokens, stop_token_ids=stops)
    tokens: list[int] = []
    forwards = drafted = 0
    first_step_s = 0.0
    first_step_tokens = 0
    started = time.perf_counter()
    state = DecodeControls(grammar=controls.start()) if controls is not None else None
    while True:
        step = decoder.step(seq, SamplingParams(), budget, len(tokens), state)
        tokens += step.tokens
        forwards += step.forwards
        drafted += step.drafted
        if not first_step_s:
            first_step_s, first_step_tokens = time.perf_counter() - started, len(tokens)
        if step.stop is not None:
            break
    seconds = time.perf_counter() - started
    seq.cache.release()
    seq.draft_session.release()
    return {
        "tokens": tokens,
        "seconds": seconds,
        "first_step_seconds": first_step_s,
        "first_step_tokens": first_step_tokens,
        "verifier_forwards": forwards,
        "draft_tokens": drafted,
    }


class Constraint:
    """The schema's compiled grammar for the model, and the stop ids that end it."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
        self.eos = compiler.eos_token_ids

    def start(self) -> Any:
        return self.compiler.start(self.spec)


def _decode_rate(run: dict[str, Any]) -> float:
    return (len(run["tokens"]) - run["first_step_tokens"]) / max(1e-9, run["seconds"] - run["first_step_seconds"])


def grammar_cost(constraint: Constraint, outputs: list[list[int]]) -> dict[str, float]:
    """Seconds per token of mask computation and advance, replaying constrained outputs without the model."""
    per_token: list[float] = []
    for tokens in outputs:
        state = constraint.start()
        for token in tokens:
            started = time.perf_counter()
            state.masks_along([])
            state.advance([token])
            per_token.append(time.perf_counter() - started)
    return {
        "mean_us": statistics.fmean(per_token) * 1e6,
        "median_us": statistics.median(per_token) * 1e6,
        "p95_us": sorted(per_token)[int(0.95 * (len(per_token) - 1))] * 1e6,
        "tokens": len(per_token),
    }


def plot(summary: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["arms"])
    fig, ax = plt.subplots(figsize=(7, 3.8))
    colors = ["tab:gray" if "unconstrained" in n else "tab:blue" for n in names]
    ax.bar(names, [summary["arms"][n]["decode_tokens_per_s"] for n in names], color=colors)
    ax.set_ylabel("decode tokens / s (prefill step excluded)")
    ax.set_title(
        f"JSON-schema constrained vs unconstrained (grammar {summary['grammar_cost']['mean_us']:.0f} µs/token)"
    )
    ax.tick_params(axis="x", rotation=15)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    verifier = TorchVerifier.load(args.model, device="cpu", dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    constraint = Constraint(GrammarCompiler.from_model_dir(args.model, verifier.vocab_size))
    draft_dir = args.draft_model or (model_drafter(args.model) if args.proposer == "dflash" else None)
    options = ProposerOptions(name=args.proposer, draft_model=draft_dir)
    proposers = {
        "none": load_proposer(ProposerOptions(), verifier, backend="torch"),
        args.proposer: load_proposer(options, verifier, backend="torch"),
    }
    prompts = [tokenizer.encode(text) for text in PROMPTS[: args.prompts]]
    arms = {
        f"{name} {kind}": (proposer, constraint if kind == "json_schema" else None)
        for name, proposer in proposers.items()
        for kind in ("unconstrained", "json_schema")
    }
    for proposer, controls in arms.values():  # warm-up: first forwards allocate; the grammar compiles once
        decode(verifier, proposer, prompts[0], argparse.Namespace(max_tokens=4), controls)

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for repeat in range(args.repeats):
        for index, prompt in enumerate(prompts):
            order = list(arms) if (repeat + index) % 2 == 0 else list(reversed(arms))
            for name in order:
                proposer, controls = arms[name]
                runs[name].append(
                    {"prompt": index, "repeat": repeat, **decode(verifier, proposer, prompt, args, controls)}
                )

    summary: dict[str, Any] = {"arms": {}}
    for name, arm_runs in runs.items():
        generated = sum(len(r["tokens"]) for r in arm_runs)
        decoded = generated - sum(r["first_step_tokens"] for r in arm_runs)
        summary["arms"][name] = {
            "tokens_per_s": generated / sum(r["seconds"] for r in arm_runs),
            "decode_tokens_per_s": decoded / sum(r["seconds"] - r["first_step_seconds"] for r in arm_runs),
            "generated_tokens": generated,
            "verifier_forwards_per_token": sum(r["verifier_forwards"] for r in arm_runs) / generated,
        }
    constrained = [r["tokens"] for r in runs["none json_schema"]]
    valid = 0
    for tokens in constrained:
        try:
            json.loads(str(tokenizer.decode(tokens[:-1] if tokens and tokens[-1] in constraint.eos else tokens)))
            valid += 1
        except json.JSONDecodeError:
            pass
    summary["constrained_valid_json_fraction"] = valid / len(constrained)
    summary["constrained_identical_with_proposer"] = [r["tokens"] for r in runs[f"{args.proposer} json_schema"]] == (
        constrained
    )
    summary["grammar_cost"] = grammar_cost(constraint, constrained)
    arms_summary = summary["arms"]
    # Runs of the same prompt and repeat ran back to back: their ratio cancels most of the machine's drift.
    summary["paired_decode_ratio_median"] = {
        name: statistics.median(
            _decode_rate(c) / _decode_rate(u)
            for c, u in zip(runs[f"{name} json_schema"], runs[f"{name} unconstrained"], strict=True)
        )
        for name in proposers
    }
    summary["constrained_vs_unconstrained"] = {
        name: arms_summary[f"{name} json_schema"]["tokens_per_s"]
        / arms_summary[f"{name} unconstrained"]["tokens_per_s"]
        for name in proposers
    }
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config["verifier"] = verifier.description
    config["schema"] = SCHEMA
    samples = {name: [{k: v for k, v in r.items()} for r in arm_runs] for name, arm_runs in runs.items()}
    path = write_results(
        "bench_structured",
        config=config,
        samples=samples,
        summary=summary,
        plot=lambda png: plot(summary, png),
        out_dir=args.results_dir,
    )
    for name, values in summary["arms"].items():
        print(
            f"{name:28s} {values['tokens_per_s']:8.1f} tok/s  {values['decode_tokens_per_s']:8.1f} decode tok/s  "
            f"{values['verifier_forwards_per_token']:.3f} fwd/tok"
        )
    cost = summary["grammar_cost"]
    print(f"grammar: {cost['mean_us']:.0f} µs/token mean, {cost['p95_us']:.0f} µs p95 over {cost['tokens']} tokens")
    print(f"constrained / unconstrained decode speed, median of paired runs: {summary['paired_decode_ratio_median']}")
    print(
        f"valid JSON {summary['constrained_valid_json_fraction']:.2f}, constrained identical with "
        f"{args.proposer}: {summary['constrained_identical_with_proposer']}"
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
