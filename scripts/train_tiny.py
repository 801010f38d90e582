"""Train the bundled kakeya-tiny family on CPU from offline data: tokenizer, verifier, DFlash drafter.

The corpus is the Python standard library's source (it ships with the interpreter; every 20th file is held
out). The verifier is a small Qwen3 (head dimension 64) trained on windows of that code and on synthetic
needle-in-a-haystack documents (a `# The secret code for KEY is VALUE.` line hidden anywhere in up to
`max(--seq-lens)` tokens of code, asked for at the end), with sequence lengths cycling through `--seq-lens`.
Its DFlash drafter is then trained by `scripts/train_dflash.py` on the verifier's own greedy continuations of
prompts cut from the training code (on `--drafter-device`, a GPU when there is one), and its acceptance is
measured by speculative decoding after prompts of held-out code.

Everything is seeded and resumable (`--resume` continues every stage from `--work`), with progress bars. The
result is a model directory (tokenizer with chat template and mask token, `config.json`, bf16 safetensors,
`dflash/` drafter, `kakeya_model.json` card data), a JSON training log in `--work`, and
`results/train_tiny_<stamp>.json` with a loss plot. `--quick` trains a toy-sized family in minutes (for tests).

Usage:
    python scripts/train_tiny.py [--out inference_engine/models/kakeya-tiny] [--work build/kakeya-tiny]
        [--steps 3000] [--drafter-steps 3000] [--resume] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_dflash
from lib.corpus import fingerprint, split_sources, stdlib_sources
from lib.niah import build_document
from lib.results import RESULTS_DIR, environment, write_results
from lib.tiny_data import BatchSampler, EncodedCorpus, encode_corpus, train_tokenizer, windows
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Recipe:
    """Sizes and schedule; `--quick` swaps in a toy recipe."""

    vocab_size: int = 4096
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 3
    num_kv_heads: int = 1
    intermediate_size: int = 576
    seq_lens: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048])
    tokens_per_step: int = 8192
    steps: int = 3000
    lr: float = 2e-3
    warmup: int = 200
    niah_fraction: float = 0.5
    answer_weight: float = 4.0
    eval_every: int = 250
    eval_windows: int = 16
    eval_docs: int = 16
    drafter_steps: int = 6000
    drafter_layers: int = 2
    drafter_block_size: int = 8
    drafter_target_layers: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    drafter_lr: float = 2e-3
    drafter_warmup: int = 200
    drafter_batch_size: int = 64
    drafter_anchors: int = 32
    # The verifier's own greedy continuations of training-code prompts: what the drafter meets when serving.
    drafter_continuations: int = 65_536
    drafter_row_len: int = 320
    drafter_prompt_lens: list[int] = field(default_factory=lambda: [16, 192])
    drafter_eval_rows: int = 64
    drafter_eval_prompts: int = 12  # acceptance is measured after prompts of held-out source
    drafter_eval_prompt_len: int = 128
    drafter_eval_tokens: int = 128
    max_files: int = 0  # 0: every corpus file


QUICK = Recipe(
    vocab_size=512,
    hidden_size=64,
    num_layers=2,
    num_heads=1,
    num_kv_heads=1,
    intermediate_size=128,
    seq_lens=[128, 256],
    tokens_per_step=1024,
    steps=40,
    lr=3e-3,
    warmup=5,
    eval_every=20,
    eval_windows=4,
    eval_docs=4,
    drafter_steps=20,
    drafter_layers=1,
    drafter_block_size=4,
    drafter_target_layers=[0, 1],
    drafter_warmup=5,
    drafter_batch_size=8,
    drafter_anchors=8,
    drafter_continuations=64,
    drafter_row_len=96,
    drafter_prompt_lens=[16, 48],
    drafter_eval_rows=4,
    drafter_eval_prompts=4,
    drafter_eval_prompt_len=32,
    drafter_eval_tokens=32,
    max_files=40,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "inference_engine" / "models" / "kakeya-tiny")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "kakeya-tiny", help="checkpoints and logs")
    p.add_argument("--quick", action="store_true", help="toy sizes and a few steps (minutes)")
    p.add_argument("--resume", action="store_true", help="continue every stage from --work")
    p.add_argument("--steps", type=int, help="verifier steps (default: the recipe's)")
    p.add_argument("--drafter-steps", type=int, help="drafter steps (default: the recipe's)")
    p.add_argument("--drafter-device", default="cpu", help="device the drafter trains on (cuda is minutes, cpu hours)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    return p.parse_args(argv)


def build_model(recipe: Recipe, tokenizer: PreTrainedTokenizerFast) -> Qwen3ForCausalLM:
    def ids(token: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(token))  # type: ignore[arg-type]

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=64,
        max_position_embeddings=4 * max(recipe.seq_lens),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=[ids("<|im_end|>"), ids("<|endoftext|>")],
        pad_token_id=ids("<|endoftext|>"),
    )
    return Qwen3ForCausalLM(config)


def weighted_loss(model: Qwen3ForCausalLM, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits  # [B, T, V]
    losses = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    return (losses * weights.flatten()).sum() / weights.sum()


@torch.no_grad()
def evaluate(model: Qwen3ForCausalLM, held: EncodedCorpus, encode: Any, recipe: Recipe, seed: int) -> dict[str, float]:
    """Held-out loss (nats per token) at the longest length, and the fraction of held-out needle documents whose
    whole answer the model predicts greedily (teacher-forced) at each length."""
    import random

    model.eval()
    longest = max(recipe.seq_lens)
    losses = [
        float(F.cross_entropy(model(input_ids=w[None, :-1]).logits[0], w[1:]))
        for w in windows(held.stream, longest, recipe.eval_windows)
    ]
    out = {"heldout_loss": sum(losses) / len(losses)}
    rng = random.Random(seed)
    for length in sorted({min(recipe.seq_lens), longest}):
        hits = 0
        for i in range(recipe.eval_docs):
            doc = build_document(held.lines, encode, length, [(i + 0.5) / recipe.eval_docs], rng)
            ids = torch.tensor([doc.prompt + doc.answer])
            predicted = model(input_ids=ids).logits[0, len(doc.prompt) - 1 : -1].argmax(-1).tolist()
            hits += predicted == doc.answer
        out[f"niah_answer_exact_{length}"] = hits / recipe.eval_docs
    model.train()
    return out


def train_verifier(
    args: argparse.Namespace,
    recipe: Recipe,
    tokenizer: PreTrainedTokenizerFast,
    train: EncodedCorpus,
    held: EncodedCorpus,
) -> tuple[Qwen3ForCausalLM, list[dict[str, Any]]]:
    torch.manual_seed(args.seed)
    model = build_model(recipe, tokenizer)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95)
    )
    sampler = BatchSampler(
        train, tokenizer, niah_fraction=recipe.niah_fraction, answer_weight=recipe.answer_weight, seed=args.seed
    )
    encode = sampler.encode
    state_file = args.work / "verifier_state.pt"
    log: list[dict[str, Any]] = []
    start = 0
    if args.resume and state_file.exists():
        state = torch.load(state_file, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.restore(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        log, start = state["log"], state["step"]

    def save(step: int) -> None:
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "sampler": sampler.state(),
                "torch_rng": torch.get_rng_state(),
                "log": log,
                "step": step,
            },
            state_file,
        )

    def lr_at(step: int) -> float:
        if step < recipe.warmup:
            return recipe.lr * (step + 1) / recipe.warmup
        progress = min(1.0, (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup))
        return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    with tqdm(range(start, recipe.steps), initial=start, total=recipe.steps, desc="train verifier") as bar:
        for step in bar:
            seq_len = recipe.seq_lens[step % len(recipe.seq_lens)]
            tokens, weights = sampler.batch(max(1, recipe.tokens_per_step // seq_len), seq_len)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            loss = weighted_loss(model, tokens, weights)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            entry: dict[str, Any] = {"step": step + 1, "seq_len": seq_len, "loss": float(loss), "lr": lr_at(step)}
            log.append(entry)
            if (step + 1) % recipe.eval_every == 0 or step + 1 == recipe.steps:
                entry.update(evaluate(model, held, encode, recipe, args.seed))
                save(step + 1)
            bar.set_postfix(loss=f"{float(loss):.3f}", len=seq_len)
    save(recipe.steps)
    model.eval()
    return model, log


def export(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """The verifier as a Hugging Face directory with bf16 weights (the bundle stays small)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.to(torch.bfloat16).save_pretrained(out)  # type: ignore[arg-type]  # transformers types .to() narrowly
    model.to(torch.float32)  # type: ignore[arg-type]
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    recipe = QUICK if args.quick else Recipe()
    recipe = Recipe(
        **{
            **asdict(recipe),
            **({"steps": args.steps} if args.steps else {}),
            **({"drafter_steps": args.drafter_steps} if args.drafter_steps else {}),
        }
    )
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.time()

    files = stdlib_sources()
    if recipe.max_files:
        files = files[: recipe.max_files]
    train_files, held_files = split_sources(files)
    tokenizer_dir = args.work / "tokenizer"
    if args.resume and (tokenizer_dir / "tokenizer.json").exists():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    else:
        print(f"training the tokenizer on {len(train_files)} files", file=sys.stderr)
        tokenizer = train_tokenizer(train_files, recipe.vocab_size)
        tokenizer.save_pretrained(tokenizer_dir)
    print("encoding the corpus", file=sys.stderr)
    train, held = encode_corpus(tokenizer, train_files), encode_corpus(tokenizer, held_files)

    model, log = train_verifier(args, recipe, tokenizer, train, held)
    export(model, tokenizer, args.out)

    prompt_file = args.work / "drafter_prompts.npy"
    np.save(prompt_file, train.stream.astype(np.int64))
    eval_file = args.work / "drafter_eval.npy"
    np.save(eval_file, held.stream.astype(np.int64))
    # Every drafter_* field of the recipe is the train_dflash flag of the same name.
    options: dict[str, Any] = {
        "--" + name.removeprefix("drafter_").replace("_", "-"): value
        for name, value in asdict(recipe).items()
        if name.startswith("drafter_")
    }
    options.update(
        {
            "--model": args.out,
            "--out": args.work / "dflash",
            "--prompt-corpus": prompt_file,
            "--eval-corpus": eval_file,
            "--device": args.drafter_device,
            "--seed": args.seed,
            "--results-dir": args.results_dir,
        }
    )
    drafter_args = [
        item
        for flag, value in options.items()
        for item in (flag, *map(str, value if isinstance(value, list) else [value]))
    ]
    train_dflash.main(drafter_args + (["--resume"] if args.resume else []))
    drafter_dir = args.out / "dflash"
    drafter_dir.mkdir(exist_ok=True)
    shutil.copy(args.work / "dflash" / "config.json", drafter_dir / "config.json")
    weights = load_file(args.work / "dflash" / "model.safetensors")
    save_file(
        {k: v.to(torch.bfloat16) for k, v in weights.items()},
        str(drafter_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    drafter_log = json.loads((args.work / "dflash" / "training_log.json").read_text())

    final = next(e for e in reversed(log) if "heldout_loss" in e)
    card = {
        "name": "kakeya-tiny",
        "architecture": "Qwen3ForCausalLM",
        "parameters": sum(p.numel() for p in model.parameters()),
        "recipe": asdict(recipe),
        "corpus": {
            "source": "Python standard library",
            "python": sys.version.split()[0],
            "train_files": len(train_files),
            "heldout_files": len(held_files),
            "train_tokens": len(train.stream),
            "sha256": fingerprint(train_files),
        },
        "verifier_eval": {k: v for k, v in final.items() if k not in ("step", "lr", "loss", "seq_len")},
        "drafter_eval": {k: v for k, v in drafter_log["summary"].items() if k != "train_seconds_this_run"},
        "drafter_training": {
            "command": drafter_log["config"].get("command"),
            "machine": drafter_log["environment"],
            "train_seconds": drafter_log["summary"].get("train_seconds_this_run"),
        },
        "seed": args.seed,
    }
    (args.out / "kakeya_model.json").write_text(json.dumps(card, indent=2) + "\n")
    (args.work / "training_log.json").write_text(json.dumps({"card": card, "log": log}, indent=2) + "\n")

    def plot(png: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([e["step"] for e in log], [e["loss"] for e in log], lw=0.5, label="train (weighted)")
        evals = [e for e in log if "heldout_loss" in e]
        ax.plot([e["step"] for e in evals], [e["heldout_loss"] for e in evals], "o-", label="held-out")
        ax.set(xlabel="step", ylabel="loss (nats/token)", title="kakeya-tiny verifier")
        ax.legend()
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        plt.close(fig)

    summary = {
        **card["verifier_eval"],
        "drafter_mean_acceptance_length": drafter_log["summary"].get("mean_acceptance_length"),
        "parameters": card["parameters"],
        "wall_seconds_this_run": round(time.time() - started, 1),
    }
    config = {**asdict(recipe), "quick": args.quick, "seed": args.seed, "environment": environment()}
    path = write_results("train_tiny", config=config, samples=log, summary=summary, plot=plot, out_dir=args.results_dir)
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out} and {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
