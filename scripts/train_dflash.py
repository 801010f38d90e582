"""Train a DFlash block-diffusion drafter for a local verifier (the verifier stays frozen).

The corpus is token ids: `.npy` files (1-D integer arrays), text files tokenized with the verifier's tokenizer,
and/or text the verifier generates itself (`--self-generate N`), which matches the verifier's own distribution.
Every step samples sequences, runs the verifier once over them for its hidden states at the target layers, and
trains the drafter on anchor-sampled blocks with the block-bidirectional mask and the position-decayed loss of
`kv_cache_proposer.proposers.dflash.training`. The run is resumable (`--resume` continues from
`OUT/train_state.pt`). At the end the drafter is written in the published DFlash format (`OUT/config.json`,
`OUT/model.safetensors`), its mean acceptance length is measured by speculative greedy decoding on held-out
prompts, and `OUT/training_log.json` plus `results/train_dflash_<stamp>.json` (+ PNG of the loss) are written.

Usage:
    python scripts/train_dflash.py --model VERIFIER_DIR --out DRAFTER_DIR [--corpus FILE ...]
        [--self-generate TOKENS [--prompt-corpus FILE] [--generate-prompt-len 16] [--generate-new-tokens N]]
        [--eval-corpus FILE] [--steps 2000] [--layers 1] [--block-size 8] [--resume]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.results import RESULTS_DIR, environment, write_results
from lib.tokens import read_tokens, spread_windows
from transformers import Qwen3Config

from kv_cache_proposer.backends.torch_backend.features import concatenated, layer_outputs
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.proposers.dflash.checkpoint import save_drafter
from kv_cache_proposer.proposers.dflash.config import DFlashSpec
from kv_cache_proposer.proposers.dflash.model import DFlashDrafter
from kv_cache_proposer.proposers.dflash.proposer import DFlashProposer
from kv_cache_proposer.proposers.dflash.training import block_loss, default_target_layers, sample_anchors
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="verifier checkpoint directory")
    p.add_argument("--out", required=True, type=Path, help="drafter output directory")
    p.add_argument("--corpus", action="append", type=Path, default=[], help=".npy token ids or a text file")
    p.add_argument("--self-generate", type=int, default=0, help="tokens of verifier-generated text to add")
    p.add_argument("--generate-temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument(
        "--generate-prompt-len", type=int, default=16, help="tokens of corpus text each self-generated row continues"
    )
    p.add_argument(
        "--prompt-corpus",
        type=Path,
        help=".npy token ids or text file the self-generated rows continue, not trained on (default: the corpus)",
    )
    p.add_argument("--generate-new-tokens", type=int, help="tokens generated per row (default: --seq-len)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--anchors", type=int, default=16, help="blocks per sequence and step")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--gamma", type=float, default=4.0, help="loss weight decay over block slots")
    p.add_argument("--layers", type=int, default=1, help="drafter decoder layers")
    p.add_argument("--target-layers", type=int, nargs="*", help="verifier layers to condition on")
    p.add_argument("--intermediate-size", type=int, default=0, help="drafter MLP width (0: the verifier's)")
    p.add_argument("--mask-token-id", type=int, help="default: the tokenizer's mask token")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--holdout-fraction", type=float, default=0.05)
    p.add_argument(
        "--eval-corpus",
        type=Path,
        help="held-out .npy token ids or text file for the evaluation prompts (default: the corpus's held-out tail)",
    )
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--eval-prompt-len", type=int, default=32)
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    for name in ("generate_prompt_len", "generate_new_tokens", "eval_prompt_len", "eval_prompts"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def load_corpus(args: argparse.Namespace, verifier: TorchVerifier) -> np.ndarray:
    parts = [read_tokens(path, args.model) for path in args.corpus]
    if args.self_generate:
        seeds = np.concatenate(parts) if parts else None
        if args.prompt_corpus is not None:
            seeds = read_tokens(args.prompt_corpus, args.model)
            if len(seeds) <= args.generate_prompt_len:
                raise SystemExit(
                    f"--prompt-corpus holds {len(seeds)} tokens, not more than --generate-prompt-len "
                    f"{args.generate_prompt_len}"
                )
        parts.append(self_generate(verifier, args, seeds))
    if not parts:
        raise SystemExit("no corpus: give --corpus files and/or --self-generate N")
    return np.concatenate(parts)


def self_generate(verifier: TorchVerifier, args: argparse.Namespace, seed_text: np.ndarray | None) -> np.ndarray:
    """Text from the verifier itself: batched continuations of short prompts (corpus slices, else random
    tokens), greedy or sampled at `--generate-temperature`."""
    generator = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    prompt_len, batch = args.generate_prompt_len, 32
    new_tokens = args.generate_new_tokens or args.seq_len
    sampling = {"do_sample": True, "temperature": args.generate_temperature} if args.generate_temperature else {}
    out: list[np.ndarray] = []
    total = 0
    with tqdm(total=args.self_generate, desc="self-generate", unit="tok") as bar:
        while total < args.self_generate:
            if seed_text is not None and len(seed_text) > prompt_len:
                starts = generator.integers(0, len(seed_text) - prompt_len, batch)
                prompts = np.stack([seed_text[s : s + prompt_len] for s in starts])
            else:
                prompts = generator.integers(0, verifier.vocab_size, (batch, prompt_len))
            with torch.no_grad():
                rows = verifier.model.generate(  # type: ignore[operator]
                    torch.from_numpy(prompts).to(verifier.device),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    pad_token_id=0,
                    **sampling,
                )
            chunk = rows.cpu().numpy().reshape(-1)
            out.append(chunk)
            total += len(chunk)
            bar.update(len(chunk))
    return np.concatenate(out)[: args.self_generate].astype(np.int64)


def build_drafter(args: argparse.Namespace, verifier: TorchVerifier) -> tuple[DFlashDrafter, DFlashSpec]:
    vconfig = verifier.model.config.get_text_config()
    layers = args.target_layers or default_target_layers(verifier.num_layers, max(2, args.layers))
    mask = args.mask_token_id
    if mask is None:
        from transformers import AutoTokenizer

        mask = AutoTokenizer.from_pretrained(args.model, local_files_only=True).mask_token_id
        if mask is None:
            raise SystemExit("the tokenizer has no mask token: pass --mask-token-id")
    head_dim = int(getattr(vconfig, "head_dim", None) or vconfig.hidden_size // vconfig.num_attention_heads)
    config = Qwen3Config(
        vocab_size=verifier.vocab_size,
        hidden_size=verifier.hidden_size,
        intermediate_size=args.intermediate_size or int(vconfig.intermediate_size),
        num_hidden_layers=args.layers,
        num_attention_heads=int(vconfig.num_attention_heads),
        num_key_value_heads=int(vconfig.num_key_value_heads),
        head_dim=head_dim,
        rms_norm_eps=float(getattr(vconfig, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(getattr(vconfig, "max_position_embeddings", 32768)),
        rope_parameters=getattr(vconfig, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False,
    )
    spec = DFlashSpec(
        block_size=args.block_size,
        target_layer_ids=tuple(layers),
        mask_token_id=int(mask),
        num_target_layers=verifier.num_layers,
    )
    torch.manual_seed(args.seed)
    return DFlashDrafter(config, len(layers)), spec


def features_of(verifier: TorchVerifier, tokens: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """The verifier's outputs of `layers` for every position [N, L, F], exactly as verify forwards capture them."""
    with torch.no_grad(), layer_outputs(verifier.model, layers) as captured:
        verifier.model(input_ids=tokens)
    return concatenated(captured, layers).float()


def mean_acceptance_length(
    drafter: DFlashDrafter, spec: DFlashSpec, verifier: TorchVerifier, prompts: list[list[int]], tokens: int
) -> dict[str, float]:
    """Greedy speculative decoding of `tokens` tokens after each prompt: tokens per verifier step, and the
    fraction of drafted tokens accepted."""
    proposer = DFlashProposer(drafter, spec, verifier)
    decoder = Decoder(verifier)
    steps = generated = drafted = accepted = 0
    for prompt in prompts:
        seq = SequenceState(
            cache=verifier.new_cache(FullStrategy()), tokens=list(prompt), draft=proposer.open(FullStrategy())
        )
        budget = GenerationBudget(max_new_tokens=tokens)
        produced = 0
        while produced < tokens:
            step = decoder.step(seq, SamplingParams(), budget, produced)
            produced += len(step.tokens)
            if step.drafted:
                steps += 1
                generated += len(step.tokens)
                drafted += step.drafted
                accepted += step.accepted
            if step.stop is not None:
                break
        seq.cache.release()
        seq.draft.release()
    return {
        "mean_acceptance_length": generated / steps if steps else 0.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "drafting_steps": steps,
    }


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    verifier = TorchVerifier.load(args.model, device=args.device, dtype="float32")
    for parameter in verifier.model.parameters():
        parameter.requires_grad_(False)
    args.out.mkdir(parents=True, exist_ok=True)
    corpus_file = args.out / "corpus.npy"
    if args.resume and corpus_file.exists():
        corpus = np.load(corpus_file)
    else:
        corpus = load_corpus(args, verifier)
        np.save(corpus_file, corpus)
    holdout = max(args.eval_prompt_len * args.eval_prompts, int(len(corpus) * args.holdout_fraction))
    train, held = torch.from_numpy(corpus[:-holdout]), corpus[-holdout:]
    if len(train) < args.seq_len + 1:
        raise SystemExit(f"the training corpus ({len(train)} tokens) is shorter than --seq-len {args.seq_len}")
    source = held if args.eval_corpus is None else read_tokens(args.eval_corpus, args.model)
    if len(source) < args.eval_prompt_len:
        raise SystemExit(
            f"the evaluation text holds {len(source)} tokens, fewer than --eval-prompt-len {args.eval_prompt_len}"
        )
    prompts = spread_windows(source, args.eval_prompts, args.eval_prompt_len)

    drafter, spec = build_drafter(args, verifier)
    drafter.to(device).train()
    embed = cast(torch.Tensor, verifier.model.get_input_embeddings().weight)
    head = verifier.model.get_output_embeddings()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    history: list[dict[str, Any]] = []
    start_step = 0
    state_file = args.out / "train_state.pt"
    if args.resume and state_file.exists():
        state = torch.load(state_file, weights_only=False)
        drafter.load_state_dict(state["drafter"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        history, start_step = state["history"], state["step"]

    def save_state(step: int) -> None:
        torch.save(
            {
                "drafter": drafter.state_dict(),
                "optimizer": optimizer.state_dict(),
                "generator": generator.get_state(),
                "history": history,
                "step": step,
            },
            state_file,
        )

    started = time.perf_counter()
    with tqdm(range(start_step, args.steps), initial=start_step, total=args.steps, desc="train dflash") as bar:
        for step in bar:
            offsets = torch.randint(0, len(train) - args.seq_len, (args.batch_size,), generator=generator)
            tokens = torch.stack([train[o : o + args.seq_len] for o in offsets.tolist()]).to(device)
            anchors = sample_anchors(args.seq_len, args.block_size, args.anchors, generator)
            features = features_of(verifier, tokens, spec.target_layer_ids)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, args)
            loss, accuracy = block_loss(
                drafter,
                embed,
                head,
                tokens,
                features,
                anchors,
                block_size=args.block_size,
                mask_token_id=spec.mask_token_id,
                gamma=args.gamma,
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            optimizer.step()
            history.append({"step": step + 1, "loss": float(loss), "slot_accuracy": accuracy.tolist()})
            bar.set_postfix(loss=f"{float(loss):.3f}", acc1=f"{float(accuracy[0]):.2f}")
            if (step + 1) % args.save_every == 0:
                save_state(step + 1)
    save_state(args.steps)
    train_seconds = time.perf_counter() - started

    drafter.eval()
    save_drafter(drafter, spec, args.out)
    evaluation = mean_acceptance_length(drafter, spec, verifier, prompts, args.eval_tokens)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config.update(
        target_layer_ids=list(spec.target_layer_ids),
        mask_token_id=spec.mask_token_id,
        corpus_tokens=len(corpus),
        holdout_tokens=int(holdout),
    )
    summary = {
        "final_loss": history[-1]["loss"] if history else None,
        "final_slot_accuracy": history[-1]["slot_accuracy"] if history else None,
        "train_seconds_this_run": round(train_seconds, 2),
        **evaluation,
    }
    log = {"config": config, "environment": environment(), "summary": summary, "history": history}
    (args.out / "training_log.json").write_text(json.dumps(log, indent=2, default=str) + "\n")

    def plot(png: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([h["step"] for h in history], [h["loss"] for h in history])
        ax.set(xlabel="step", ylabel="weighted block loss", title="DFlash drafter training")
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        plt.close(fig)

    path = write_results(
        "train_dflash", config=config, samples=history, summary=summary, plot=plot, out_dir=args.results_dir
    )
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out} and {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
