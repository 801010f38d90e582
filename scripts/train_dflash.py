"""Train a DFlash block-diffusion drafter for a local verifier (the verifier stays frozen).

What a drafter must predict at serving time is the verifier's own continuation of whatever it is given, so the
training rows are mostly exactly that: prompts cut from a text corpus (`--prompt-corpus`, of varied lengths
`--prompt-lens`), each continued greedily by the verifier up to `--row-len` tokens (`--continuations ROWS`); blocks
are anchored only in the continuations. Plain corpus rows (`--corpus`, anchored anywhere) can be mixed in. Every
step runs the verifier over a batch of rows for its features at the target layers (transformers'
`hidden_states[i + 1]` convention, as the engine captures them) and trains the drafter on anchor-sampled blocks
with the block-bidirectional mask and the position-decayed loss of `kv_cache_proposer.proposers.dflash.training`.

Held-out acceptance is logged during training (`--eval-every`): continuations of prompts from `--eval-corpus`
(text neither model trained on) give, block by block, exactly the tokens greedy speculative decoding would accept
there. At the end the drafter is written in the published DFlash format (`OUT/config.json`,
`OUT/model.safetensors`), its mean acceptance length is measured by real speculative greedy decoding after held-out
prompts, and `OUT/training_log.json` plus `results/train_dflash_<stamp>.json` (+ PNG) are written; both record the
command line and the machine. The run is resumable (`--resume` continues from `OUT/train_state.pt`) and runs on a
CPU or, faster, on a GPU (`--device cuda`).

Usage:
    python scripts/train_dflash.py --model VERIFIER_DIR --out DRAFTER_DIR
        [--continuations ROWS --prompt-corpus FILE [--prompt-lens 16 192] [--row-len 320]] [--corpus FILE ...]
        [--eval-corpus FILE] [--steps 2000] [--layers 1] [--block-size 8] [--device cpu] [--resume]
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.drafter_rows import Rows, load_rows
from lib.results import RESULTS_DIR, environment, write_results
from transformers import Qwen3Config

from kv_cache_proposer.backends.torch_backend.features import concatenated, layer_outputs
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.proposers.base import DraftPolicy
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
    p.add_argument("--corpus", action="append", type=Path, default=[], help="plain rows: .npy token ids or a text file")
    p.add_argument("--continuations", type=int, default=0, help="rows of verifier continuations to generate")
    p.add_argument(
        "--prompt-corpus",
        type=Path,
        help=".npy token ids or text file the continuations start from (default: --corpus)",
    )
    p.add_argument(
        "--prompt-lens", type=int, nargs=2, default=[16, 192], metavar=("MIN", "MAX"), help="prompt length range"
    )
    p.add_argument("--row-len", type=int, default=320, help="tokens per training row (prompt + continuation)")
    p.add_argument("--generate-batch", type=int, default=64, help="rows generated per verifier generate() call")
    p.add_argument("--generate-temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=8, help="rows per step")
    p.add_argument("--anchors", type=int, default=16, help="blocks per row and step")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--gamma", type=float, default=4.0, help="loss weight decay over block slots")
    p.add_argument("--layers", type=int, default=1, help="drafter decoder layers")
    p.add_argument("--target-layers", type=int, nargs="*", help="verifier layers to condition on")
    p.add_argument("--intermediate-size", type=int, default=0, help="drafter MLP width (0: the verifier's)")
    p.add_argument("--mask-token-id", type=int, help="default: the tokenizer's mask token")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument(
        "--eval-corpus",
        type=Path,
        help="held-out .npy token ids or text file for evaluation prompts (default: the held-out tail of the prompts)",
    )
    p.add_argument("--holdout-fraction", type=float, default=0.05, help="without --eval-corpus: the tail held out")
    p.add_argument("--eval-rows", type=int, default=16, help="held-out continuation rows for the training curve")
    p.add_argument("--eval-every", type=int, default=200, help="steps between held-out acceptance measurements")
    p.add_argument("--eval-prompts", type=int, default=8, help="prompts of the final speculative-decoding check")
    p.add_argument("--eval-prompt-len", type=int, default=32)
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    p.add_argument(
        "--time-limit", type=float, default=0, help="stop training after this many seconds (0: run every step)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    for name in ("row_len", "eval_prompt_len", "eval_prompts", "eval_tokens", "eval_every", "generate_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    low, high = args.prompt_lens
    if not 1 <= low <= high or high + args.block_size > args.row_len:
        p.error(f"--prompt-lens {low} {high} must satisfy 1 <= MIN <= MAX and MAX + --block-size <= --row-len")
    return args


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
    """Greedy speculative decoding of `tokens` tokens after each prompt, every proposal a full block: tokens per
    verifier step, and the fraction of drafted tokens accepted."""
    proposer = DFlashProposer(drafter, spec, verifier)
    decoder = Decoder(verifier, draft_policy=DraftPolicy.FULL)
    steps = generated = drafted = accepted = 0
    for prompt in prompts:
        seq = SequenceState(
            cache=verifier.new_cache(FullStrategy()), tokens=list(prompt), draft_session=proposer.open(FullStrategy())
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
        seq.draft_session.release()
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


def row_anchors(first: np.ndarray, length: int, args: argparse.Namespace, generator: torch.Generator) -> torch.Tensor:
    """`--anchors` anchors per row at or after the row's first anchor position [N, A]."""
    return torch.stack([sample_anchors(length, args.block_size, args.anchors, generator, first=int(f)) for f in first])


def held_out_acceptance(
    drafter: DFlashDrafter, spec: DFlashSpec, verifier: TorchVerifier, held: Rows, args: argparse.Namespace
) -> float:
    """Mean greedy acceptance length over blocks anchored at every continuation position of the held-out rows."""
    embed = cast(torch.Tensor, verifier.model.get_input_embeddings().weight)
    head = verifier.model.get_output_embeddings()
    length = held.tokens.shape[1]
    anchors = torch.arange(int(held.first_anchor[0]), length - args.block_size + 1)
    total = weight = 0.0
    drafter.eval()
    with torch.no_grad():
        for begin in range(0, len(held), 4):
            tokens = torch.from_numpy(held.tokens[begin : begin + 4]).to(verifier.device)
            features = features_of(verifier, tokens, spec.target_layer_ids)
            stats = block_loss(
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
            total += stats.acceptance_length * len(tokens)
            weight += len(tokens)
    drafter.train()
    return total / weight


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    verifier = TorchVerifier.load(args.model, device=args.device, dtype="float32")
    for parameter in verifier.model.parameters():
        parameter.requires_grad_(False)
    args.out.mkdir(parents=True, exist_ok=True)
    rows_file = args.out / "rows.npz"
    if args.resume and rows_file.exists():
        saved = np.load(rows_file)
        train = Rows(saved["train"].astype(np.int64), saved["train_first"])
        held = Rows(saved["held"].astype(np.int64), saved["held_first"])
        prompts = [list(map(int, p)) for p in saved["prompts"]]
    else:
        train, held, prompts = load_rows(args, verifier)
        np.savez_compressed(  # token ids fit int32: a quarter of the int64 size before compression
            rows_file,
            train=train.tokens.astype(np.int32),
            train_first=train.first_anchor,
            held=held.tokens.astype(np.int32),
            held_first=held.first_anchor,
            prompts=np.asarray(prompts, dtype=np.int32),
        )
    length = train.tokens.shape[1]
    if int(train.first_anchor.max()) + args.block_size + args.anchors - 1 > length:
        raise SystemExit(f"rows of {length} tokens hold fewer than --anchors {args.anchors} blocks after the prompt")

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
            picks = torch.randint(0, len(train), (args.batch_size,), generator=generator).numpy()
            tokens = torch.from_numpy(train.tokens[picks]).to(device)
            anchors = row_anchors(train.first_anchor[picks], length, args, generator)
            features = features_of(verifier, tokens, spec.target_layer_ids)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, args)
            stats = block_loss(
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
            stats.loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            optimizer.step()
            entry: dict[str, Any] = {
                "step": step + 1,
                "loss": float(stats.loss),
                "slot_accuracy": stats.slot_accuracy.tolist(),
                "train_acceptance_length": stats.acceptance_length,
            }
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                entry["heldout_acceptance_length"] = held_out_acceptance(drafter, spec, verifier, held, args)
                bar.write(f"step {step + 1}: held-out acceptance length {entry['heldout_acceptance_length']:.3f}")
            history.append(entry)
            bar.set_postfix(loss=f"{float(stats.loss):.3f}", accept=f"{stats.acceptance_length:.2f}")
            if (step + 1) % args.save_every == 0:
                save_state(step + 1)
            if args.time_limit and time.perf_counter() - started > args.time_limit and step + 1 < args.steps:
                bar.write(f"--time-limit {args.time_limit:g} s reached after step {step + 1} of {args.steps}")
                break
    steps_done = history[-1]["step"] if history else start_step
    if history and "heldout_acceptance_length" not in history[-1]:
        history[-1]["heldout_acceptance_length"] = held_out_acceptance(drafter, spec, verifier, held, args)
    save_state(steps_done)
    train_seconds = time.perf_counter() - started

    drafter.eval()
    save_drafter(drafter, spec, args.out)
    evaluation = mean_acceptance_length(drafter, spec, verifier, prompts, args.eval_tokens)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config.update(
        target_layer_ids=list(spec.target_layer_ids),
        mask_token_id=spec.mask_token_id,
        training_rows=len(train),
        row_len=length,
        heldout_rows=len(held),
        command=shlex.join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
    )
    evals = [h for h in history if "heldout_acceptance_length" in h]
    summary = {
        "final_loss": history[-1]["loss"] if history else None,
        "final_slot_accuracy": history[-1]["slot_accuracy"] if history else None,
        "heldout_acceptance_length": evals[-1]["heldout_acceptance_length"] if evals else None,
        "train_seconds_this_run": round(train_seconds, 2),
        "steps_done": steps_done,
        **evaluation,
    }
    log = {"config": config, "environment": environment(), "summary": summary, "history": history}
    (args.out / "training_log.json").write_text(json.dumps(log, indent=2, default=str) + "\n")

    def plot(png: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        left.plot([h["step"] for h in history], [h["loss"] for h in history])
        left.set(xlabel="step", ylabel="weighted block loss", title="DFlash drafter training")
        right.plot([h["step"] for h in evals], [h["heldout_acceptance_length"] for h in evals], "o-")
        right.set(xlabel="step", ylabel="tokens per verify step", title="held-out greedy acceptance length")
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
