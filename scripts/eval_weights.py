"""The quality of each `--weights` choice against float32 on the same model and texts: teacher-forced perplexity on
held-out prose (the Python reference manual's topics, `pydoc_data`) and code (held-out standard-library modules) in
windows of `--context` tokens, and greedy agreement with float32 over `--agree-tokens` tokens from chat prompts.

Each choice is loaded as the daemon loads it (`TorchVerifier.load(..., weights=...)`) and run through its model's
modules; the weights' rounding is what differs between the arms. For each choice of `--kv-arms`, two more arms run
through the verifier's own session cache, as the daemon does (a window verified as one block, greedy tokens one
forward each): `<weights>:kv=model` holds K/V in float32, `<weights>:kv=bfloat16` rounds them to bfloat16
(`--kv-dtype`); the K/V's rounding is what differs between those two.

Usage:
    .venv/bin/python scripts/eval_weights.py                                   # SmolLM2, every choice
    .venv/bin/python scripts/eval_weights.py --weights float32 int4 --kv-arms int4  # and int4's K/V precisions
    .venv/bin/python scripts/eval_weights.py --model kakeya-tiny --weights float32 int8 --windows 1 --prompts 1
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.corpus import manual_sections, read_text, split_sources, stdlib_sources
from lib.results import RESULTS_DIR, write_results
from lib.tokens import shared_prefix

from inference_engine.model_source import resolve_model
from kv_cache_proposer.backends import WEIGHTS
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.strategies import FullStrategy

QUESTIONS = (
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "Give three tips for staying focused while studying.",
    "Explain in two sentences what a hash table is.",
    "What is the boiling point of water at sea level?",
    "Translate 'good morning' into Spanish and German.",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name, directory or GGUF file")
    p.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=WEIGHTS, help="choices (float32 first)")
    p.add_argument("--context", type=int, default=2048, help="tokens per perplexity window")
    p.add_argument("--windows", type=int, default=4, help="windows per text kind")
    p.add_argument("--agree-tokens", type=int, default=128, help="greedy tokens compared with float32 per prompt")
    p.add_argument("--prompts", type=int, default=4, help="chat prompts for greedy agreement")
    p.add_argument(
        "--kv-arms",
        nargs="*",
        default=[],
        choices=WEIGHTS,
        help="choices also run through the session cache, K/V held in float32 and at bfloat16",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    return p.parse_args(argv)


def texts(tokenizer: Any, context: int, windows: int) -> dict[str, list[list[int]]]:
    """Token windows of held-out prose and code, the same for every arm."""
    prose = "\n\n".join(text for _, text in manual_sections())
    _, held_out = split_sources(stdlib_sources())
    code = "\n\n".join(read_text(path) for path in held_out)
    out: dict[str, list[list[int]]] = {}
    for kind, text in (("prose", prose), ("code", code)):
        ids = tokenizer(text)["input_ids"]
        out[kind] = [ids[i * context : (i + 1) * context] for i in range(windows) if (i + 1) * context <= len(ids)]
    return out


class ModulePath:
    """A model run through its transformers modules: logits of a window, greedy tokens with transformers' cache."""

    def __init__(self, model: Any) -> None:
        self.model = model

    @torch.inference_mode()
    def logits(self, window: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([window])).logits[0].float()  # [T, V]

    @torch.inference_mode()
    def greedy(self, prompt: list[int], steps: int) -> list[int]:
        out = self.model(torch.tensor([prompt]), use_cache=True)
        past, tokens = out.past_key_values, [int(out.logits[0, -1].argmax())]
        for _ in range(steps - 1):
            out = self.model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
        return tokens


class SessionPath:
    """A verifier's model run through its own session cache, as the daemon runs it."""

    def __init__(self, verifier: TorchVerifier) -> None:
        self.verifier = verifier

    @torch.inference_mode()
    def logits(self, window: list[int]) -> torch.Tensor:
        """Logits [T, V] of every position of `window`, verified as one block of a fresh session."""
        return self.verifier.verify(self.verifier.new_cache(FullStrategy()), window, len(window)).logits.float()

    @torch.inference_mode()
    def greedy(self, prompt: list[int], steps: int) -> list[int]:
        cache = self.verifier.new_cache(FullStrategy())
        block = prompt
        tokens: list[int] = []
        while len(tokens) < steps:
            tokens.append(int(self.verifier.verify(cache, block, 1).logits[-1].argmax()))
            self.verifier.commit(cache, len(block))
            block = tokens[-1:]
        return tokens


def negative_log_likelihood(arm: ModulePath | SessionPath, window: list[int]) -> tuple[float, int]:
    ids = torch.tensor(window)
    nll = torch.nn.functional.cross_entropy(arm.logits(window)[:-1], ids[1:], reduction="sum")
    return float(nll), len(window) - 1


def load_arm(directory: Path, arm: str) -> ModulePath | SessionPath:
    """The model of arm `<weights>` (its modules) or `<weights>:kv=<kv dtype>` (through its session cache)."""
    weights, _, kv = arm.partition(":kv=")
    verifier = TorchVerifier.load(directory, device="cpu", dtype="float32", weights=weights, kv_dtype=kv or "auto")
    return SessionPath(verifier) if kv else ModulePath(verifier.model)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    resolved = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(resolved.directory), local_files_only=True)
    windows = texts(tokenizer, args.context, args.windows)
    rendered = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS[: args.prompts]
    ]
    prompts = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in rendered]
    choices = ["float32", *[w for w in args.weights if w != "float32"]]
    choices += [f"{w}:kv={kv}" for w in args.kv_arms for kv in ("model", "bfloat16")]
    samples: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    reference: list[list[int]] = []
    for choice in choices:
        started = time.monotonic()
        model = load_arm(resolved.directory, choice)
        row: dict[str, Any] = {}
        for kind, rows in windows.items():
            nll = tokens = 0.0
            for window in rows:
                n, t = negative_log_likelihood(model, window)
                nll, tokens = nll + n, tokens + t
            row[f"ppl_{kind}"] = math.exp(nll / tokens)
        generations = [model.greedy(prompt, args.agree_tokens) for prompt in prompts]
        if choice == "float32":
            reference = generations
        matches = [sum(a == b for a, b in zip(g, r, strict=True)) for g, r in zip(generations, reference, strict=True)]
        prefixes = [shared_prefix(g, r) for g, r in zip(generations, reference, strict=True)]
        row["greedy_agreement"] = sum(matches) / (len(prompts) * args.agree_tokens)
        row["identical_prefix_mean"] = sum(prefixes) / len(prompts)
        row["seconds"] = time.monotonic() - started
        summary[choice] = row
        samples.append({"weights": choice, **row, "generations": generations})
        print(choice, {k: round(v, 4) for k, v in row.items()}, flush=True)
        del model
    base = summary["float32"]
    for row in summary.values():
        for kind in windows:
            row[f"ppl_{kind}_vs_float32"] = row[f"ppl_{kind}"] / base[f"ppl_{kind}"] - 1

    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.8))
        names = list(summary)
        for offset, kind in ((-0.2, "prose"), (0.2, "code")):
            ax.bar(
                [i + offset for i in range(len(names))],
                [100 * summary[n][f"ppl_{kind}_vs_float32"] for n in names],
                0.4,
                label=f"{kind} perplexity",
            )
        ax.axhline(2, color="grey", linestyle="--", linewidth=0.8, label="+2 %")
        ax.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
        ax.set_ylabel("perplexity vs float32 (%)")
        ax.set_title(f"{args.model}: {args.context}-token windows")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)

    config = {
        **{k: v for k, v in vars(args).items() if k != "out"},
        "directory": str(resolved.directory),
        "windows_per_kind": {k: len(v) for k, v in windows.items()},
    }
    print(write_results("eval_weights", config=config, samples=samples, summary=summary, plot=plot, out_dir=args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
