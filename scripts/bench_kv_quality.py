"""The quality of each K/V format on one model and one set of texts: KakeyaLattice next to the formats users pick
instead (`lib/kv_formats.py`: llama.cpp's q8_0 and q4_0 with and without its rotation, fp8 e4m3, mlx-lm's affine
groups), plus mlx-lm's own quantized cache run through mlx-lm on the MLX copy of the model.

Measured per format, the same texts for every arm:
- teacher-forced perplexity and mean KL(none ‖ format) of the next-token distribution, on held-out prose (the
  Python reference manual, `pydoc_data`), code (held-out standard-library modules) and chat transcripts (the
  model's chat template around turns that ask about a manual section or a module and answer with it) in windows
  of each `--contexts` length;
- greedy agreement with `none` over `--agree-tokens` tokens, and chat needle recall: a fact in a long document,
  the question in the user turn (`lib/niah.py`), answered greedily;
- bits per value actually held (what the format stores of the K/V the model computed on these texts).

A compressed cache is used so, and measured so: every query reads its own position's K/V as the forward computed
them and every earlier position's as the format reads them back (the daemon's compressed sessions do the same).
Here that is an attention function registered with transformers for the bench: each layer's K/V pass through the
format once (kept between decode steps), and each query's attention is the log-sum-exp merge of its earlier
positions (read back) and its own (as computed).

mlx-lm's arm runs `mlx_lm` itself (`QuantizedKVCache`, group 64, in chunks of `--mlx-chunk` tokens; within a chunk
mlx-lm reads the chunk's own K/V quantized too), against mlx-lm's own unquantized run of the same model for Δ
perplexity and KL.

Writes `results/bench_kv_quality_<stamp>.json` and a PNG (bits per value against Δ perplexity and KL).

Usage:
    .venv/bin/python scripts/bench_kv_quality.py --model smollm2-135m-instruct   # every arm
    .venv/bin/python scripts/bench_kv_quality.py --needle-kind code              # kakeya-tiny (no chat skills)
    .venv/bin/python scripts/bench_kv_quality.py --formats none,kakeya_d4:38,q4_0 --contexts 256 \\
        --needles 2 --needle-kind code --agree-prompts 1 --agree-tokens 16 --mlx-bits none   # a smoke run
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.corpus import manual_sections, read_text, split_sources, stdlib_sources
from lib.format_attention import ATTENTION, FormatAttention
from lib.kv_distortion import distortion, nll_and_kl, verdicts
from lib.kv_formats import kv_format
from lib.mlx_copy import mlx_copy
from lib.model_option import add_model_option
from lib.niah import build_chat_document, build_document
from lib.results import RESULTS_DIR, write_results
from lib.tokens import shared_prefix


@dataclass(frozen=True, slots=True)
class Needle:
    prompt: list[int]  # ends where the answer begins
    value: str  # recalled when the answer's text holds it


DEFAULT_FORMATS = (
    "none,kakeya_d4:10,kakeya_d4:19,kakeya_d4:38,kakeya_d4:76,kakeya_e8:37,kakeya_d4s:10,kakeya_d4s:19,kakeya_d4s:38,"
    "kakeya_e8s:37,"
    "q8_0,q4_0,q4_0_rot,fp8_e4m3,affine8_g64,affine4_g64"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(p, "the model measured")
    p.add_argument("--formats", default=DEFAULT_FORMATS, help="comma-separated K/V formats (none first)")
    p.add_argument("--contexts", default="2048,8192", help="comma-separated perplexity window lengths (tokens)")
    p.add_argument("--windows", type=int, default=1, help="windows per text kind and context length")
    p.add_argument("--needles", type=int, default=6, help="needle documents")
    p.add_argument(
        "--needle-kind",
        choices=("chat", "code"),
        default="chat",
        help="chat: a prose document and the question in a user turn (chat template); code: source code with the "
        "fact and question as comments, ending with the answer prefix (for a model without a chat template)",
    )
    p.add_argument("--needle-tokens", type=int, default=2048, help="tokens per needle document")
    p.add_argument("--answer-tokens", type=int, default=24, help="greedy tokens a needle answer may take")
    p.add_argument("--agree-prompts", type=int, default=2, help="needle documents continued for greedy agreement")
    p.add_argument("--agree-tokens", type=int, default=256, help="greedy tokens compared with none per prompt")
    p.add_argument(
        "--mlx-bits",
        default="8,4",
        help="mlx-lm QuantizedKVCache bits to run, or 'none' (mlx-lm's CPU forward is slow: over 20 minutes per arm "
        "for SmolLM2's windows on a 2-core CPU)",
    )
    p.add_argument("--mlx-chunk", type=int, default=512, help="tokens per mlx-lm forward")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = p.parse_args(argv)
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not args.formats or args.formats[0] != "none":
        p.error("--formats must start with none (the reference)")
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.mlx_bits = [] if args.mlx_bits == "none" else [int(b) for b in args.mlx_bits.split(",")]
    if min(args.contexts) < 16 or args.windows < 1 or args.agree_prompts > args.needles:
        p.error("contexts must be >= 16, --windows >= 1 and --agree-prompts <= --needles")
    return args


# -- texts --------------------------------------------------------------------------------------------------------


def _held_out_modules() -> list[tuple[str, str]]:
    _, held_out = split_sources(stdlib_sources())
    return [(path.stem, read_text(path)) for path in held_out]


def chat_transcript(tokenizer: Any, rng: random.Random) -> str:
    """Turns that ask about a manual section or a module and answer with it, rendered by the chat template."""
    sections, modules = manual_sections(), _held_out_modules()
    messages = [{"role": "system", "content": "You are a helpful assistant who knows Python well."}]
    for _ in range(24):
        if rng.random() < 0.5:
            name, body = rng.choice(sections)
            ask = f"Explain the Python topic '{name}'."
        else:
            name, body = rng.choice(modules)
            ask = f"Show me the source of the standard-library module {name}."
        messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": body[:6000]}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False))


def text_windows(tokenizer: Any, contexts: list[int], windows: int, seed: int) -> dict[str, list[list[int]]]:
    """`windows` windows of every length in `contexts` per text kind, the same for every arm."""
    prose = "\n\n".join(body for _, body in manual_sections())
    code = "\n\n".join(body for _, body in _held_out_modules())
    kinds = {"prose": prose, "code": code}
    if getattr(tokenizer, "chat_template", None):
        rng = random.Random(seed)
        kinds["chat"] = "".join(chat_transcript(tokenizer, rng) for _ in range(8))
    out: dict[str, list[list[int]]] = {}
    for kind, text in kinds.items():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for context in contexts:
            # windows spread over the text, so the lengths do not all read its beginning
            stride = max(context, (len(ids) - context) // max(1, windows))
            rows = [ids[i * stride : i * stride + context] for i in range(windows)]
            rows = [row for row in rows if len(row) == context]
            if rows:
                out[f"{kind}@{context}"] = rows
    return out


# -- measurements -------------------------------------------------------------------------------------------------


@torch.inference_mode()
def log_probs(model: Any, window: list[int]) -> torch.Tensor:
    """Next-token log-probabilities `[T-1, V]` of a teacher-forced window."""
    logits = model(torch.tensor([window]), use_cache=False).logits[0, :-1].float()
    return F.log_softmax(logits, dim=-1)


@torch.inference_mode()
def greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    cache = DynamicCache()
    out = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def needle_documents(tokenizer: Any, args: argparse.Namespace) -> list[Needle]:
    """`--needles` documents at depths spread evenly from the start to the end, the same for every arm."""
    rng = random.Random(args.seed + 1)
    depths = [(i + 0.5) / args.needles for i in range(args.needles)]
    if args.needle_kind == "chat":
        filler = [body for _, body in manual_sections()]
        chats = [build_chat_document(tokenizer, filler, args.needle_tokens, depth, rng) for depth in depths]
        return [Needle(doc.prompt, doc.value) for doc in chats]
    _, held_out = split_sources(stdlib_sources())
    lines = [
        tokenizer(line, add_special_tokens=False)["input_ids"]
        for path in held_out
        for line in read_text(path).splitlines(keepends=True)
        if line.strip()
    ]

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    codes = [build_document(lines, encode, args.needle_tokens, [depth], rng) for depth in depths]
    return [Needle(doc.prompt, doc.needles[-1].value) for doc in codes]


# -- mlx-lm's own quantized cache ----------------------------------------------------------------------------------


def mlx_arms(
    model_dir: Path, windows: dict[str, list[list[int]]], bits: list[int], chunk: int
) -> dict[str, dict[str, Any]]:
    """Per mlx-lm arm ("mlx_lm" unquantized, "mlx_lm_kv8", ...): per text kind NLL, KL to mlx-lm's unquantized run,
    token counts, and the bits per value its cache holds."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    with mlx_copy(model_dir) as path:
        model = load(str(path))[0]
        rows: dict[str, dict[str, Any]] = {}
        reference: dict[tuple[str, int], np.ndarray] = {}
        for arm_bits in [0, *bits]:
            name = "mlx_lm" if arm_bits == 0 else f"mlx_lm_kv{arm_bits}"
            started = time.monotonic()
            row: dict[str, Any] = {"kinds": {}}
            for kind, rows_of_kind in windows.items():
                nll = kl = 0.0
                tokens = 0
                for index, window in enumerate(rows_of_kind):
                    layers = len(model.layers)
                    cache: list[Any] = [
                        KVCache() if arm_bits == 0 else QuantizedKVCache(group_size=64, bits=arm_bits)
                        for _ in range(layers)
                    ]
                    parts = []
                    for start in range(0, len(window), chunk):
                        logits = model(mx.array([window[start : start + chunk]]), cache=cache)
                        parts.append(np.array(logits[0].astype(mx.float32)))
                    logits_np = np.concatenate(parts)[:-1]
                    lp = torch.from_numpy(logits_np).log_softmax(-1)
                    if arm_bits == 0:
                        reference[(kind, index)] = lp.numpy()
                    ref = torch.from_numpy(reference[(kind, index)])
                    n, k = nll_and_kl(ref, lp, torch.tensor(window[1:]))
                    nll, kl, tokens = nll + n, kl + k, tokens + len(window) - 1
                row["kinds"][kind] = {"nll": nll, "kl": kl, "tokens": tokens}
            row["bits_per_value"] = 32.0 if arm_bits == 0 else arm_bits + 2 * 32 / 64  # float32 scale and bias
            row["seconds"] = time.monotonic() - started
            rows[name] = row
            print(name, f"{row['seconds']:.0f}s", flush=True)
        return rows


# -- the run --------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir: Path = args.model
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    attention = FormatAttention()
    AttentionInterface.register(ATTENTION, attention)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), local_files_only=True, dtype=torch.float32, attn_implementation=ATTENTION
    ).eval()
    windows = text_windows(tokenizer, args.contexts, args.windows, args.seed)
    documents = needle_documents(tokenizer, args)
    formats = [kv_format(name) for name in args.formats]
    print("windows:", {k: len(v) for k, v in windows.items()}, "needle documents:", len(documents), flush=True)

    totals: dict[str, dict[str, Any]] = {f.name: {"kinds": {}, "held_bits": 0.0, "values": 0} for f in formats}
    for kind, rows in windows.items():
        for window in rows:
            targets = torch.tensor(window[1:])
            reference: torch.Tensor | None = None
            for fmt in formats:
                started = time.monotonic()
                attention.use(fmt)
                attention.held_bits, attention.values = 0.0, 0
                measured = log_probs(model, window)
                if reference is None:
                    reference = measured
                nll, kl = nll_and_kl(reference, measured, targets)
                entry = totals[fmt.name]["kinds"].setdefault(kind, {"nll": 0.0, "kl": 0.0, "tokens": 0})
                entry["nll"] += nll
                entry["kl"] += kl
                entry["tokens"] += len(window) - 1
                totals[fmt.name]["held_bits"] += attention.held_bits
                totals[fmt.name]["values"] += attention.values
                print(
                    f"{kind} {fmt.name}: ppl {math.exp(nll / (len(window) - 1)):.4f} "
                    f"({time.monotonic() - started:.0f}s)",
                    flush=True,
                )
            del reference

    generations: dict[str, list[list[int]]] = {}
    for fmt in formats:
        outputs = []
        for index, document in enumerate(documents):
            attention.use(fmt)
            steps = args.agree_tokens if index < args.agree_prompts else args.answer_tokens
            outputs.append(greedy(model, document.prompt, max(steps, args.answer_tokens)))
        generations[fmt.name] = outputs
        print(f"needles {fmt.name}: done", flush=True)

    samples: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"formats": {}}
    base_kinds = totals["none"]["kinds"]
    for fmt in formats:
        total = totals[fmt.name]
        row: dict[str, Any] = {
            "family": fmt.family,
            "bits_per_value": total["held_bits"] / total["values"] if total["values"] else None,
        }
        row.update(distortion(total["kinds"], base_kinds))
        if documents:
            outputs = generations[fmt.name]
            answers = [tokenizer.decode(o[: args.answer_tokens], skip_special_tokens=True) for o in outputs]
            recalled = [doc.value in text for doc, text in zip(documents, answers, strict=True)]
            row["needle_recall"] = sum(recalled) / len(recalled)
            agree = [
                (outputs[i][: args.agree_tokens], generations["none"][i][: args.agree_tokens])
                for i in range(args.agree_prompts)
            ]
            row["greedy_agreement"] = float(
                np.mean([np.mean([a == b for a, b in zip(x, y, strict=True)]) for x, y in agree])
            )
            row["identical_prefix_mean"] = float(np.mean([shared_prefix(x, y) for x, y in agree]))
            samples.append({"format": fmt.name, "answers": answers, "recalled": recalled, "generations": outputs})
        summary["formats"][fmt.name] = row
        print(fmt.name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)

    if args.mlx_bits:
        mlx_rows = mlx_arms(model_dir, windows, args.mlx_bits, args.mlx_chunk)
        base = mlx_rows["mlx_lm"]["kinds"]
        for name, mrow in mlx_rows.items():
            if name == "mlx_lm":
                continue
            row = {"family": "field (mlx-lm itself)", "bits_per_value": mrow["bits_per_value"]}
            row.update(distortion(mrow["kinds"], base))
            summary["formats"][name] = row
            print(name, row, flush=True)

    summary["verdicts"] = verdicts(summary["formats"])
    for line in summary["verdicts"]:
        print(line)

    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        rows = {k: v for k, v in summary["formats"].items() if k != "none" and v["bits_per_value"] is not None}
        style = {"kakeya": ("tab:blue", "o"), "dense": ("tab:grey", "s")}
        for ax, key, label in ((axes[0], "dppl_pct_mean", "Δ perplexity vs none (%)"), (axes[1], "kl_mean", "KL")):
            for name, row in rows.items():
                color, marker = style.get(row["family"], ("tab:red", "^"))
                value = max(row[key], 1e-6) if key == "kl_mean" else row[key]
                ax.scatter(row["bits_per_value"], value, color=color, marker=marker)
                ax.annotate(name, (row["bits_per_value"], value), fontsize=7, xytext=(3, 3), textcoords="offset points")
            ax.set_xlabel("bits per value held")
            ax.set_ylabel(label)
            if key == "kl_mean":
                ax.set_yscale("log")
            else:
                ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
            ax.grid(alpha=0.3)
        fig.suptitle(f"{model_dir.name}: K/V formats (blue: KakeyaLattice, red: the field's, grey: dense)")
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    config = {
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
        "windows": {k: len(v) for k, v in windows.items()},
        "needle_documents": len(documents),
    }
    print(
        write_results("bench_kv_quality", config=config, samples=samples, summary=summary, plot=plot, out_dir=args.out)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
