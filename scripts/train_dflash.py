"""Train a DFlash block-diffusion drafter for a local verifier (the verifier stays frozen).

What a drafter must predict at serving time is the verifier's own continuation of whatever it is given, so the
training rows are mostly exactly that: either prompts cut from a text corpus (`--prompt-corpus`, of varied lengths
`--prompt-lens`), each continued greedily by the verifier up to `--row-len` tokens (`--continuations ROWS`), or the
prompts of a prompt file (`--prompts`, made by scripts/make_drafter_prompts.py: chat-formatted prompts of every
length up to the model's context), each continued greedily for up to `--new-tokens` tokens or until the verifier
ends its turn. Blocks are anchored only in the continuations. Plain corpus rows (`--corpus`, anchored anywhere) can
be mixed in. Every step runs the verifier over a batch of rows of similar length (at most `--batch-tokens` tokens)
for its features at the target layers (transformers' `hidden_states[i + 1]` convention, as the engine captures
them) and trains the drafter on anchor-sampled blocks with the block-bidirectional mask and the position-decayed
loss of `kv_cache_proposer.proposers.dflash.training`.

`--sliding-window W` gives every drafter layer a window of W positions over the context, which bounds what a
session's drafter holds; `--train-windows` draws each step's window from a list (0: the whole context), so one
drafter serves under any of them and the final log measures held-out acceptance under each, by prompt length.

Held-out acceptance is logged during training (`--eval-every`): continuations of prompts from `--eval-corpus`
(text neither model trained on) give, block by block, exactly the tokens greedy speculative decoding would accept
there. At the end the drafter of the run's best held-out measurement is written in the published DFlash format
(`OUT/config.json`, `OUT/model.safetensors`), its mean acceptance length is measured by real speculative greedy
decoding after held-out prompts, and `OUT/training_log.json` plus `results/train_dflash_<stamp>.json` (+ PNG) are
written; both record the command line and the machine. The run is resumable (`--resume` continues from
`OUT/train_state.pt`) and runs on a CPU or, faster, on a GPU (`--device cuda`).

Usage:
    python scripts/train_dflash.py --model VERIFIER_DIR --out DRAFTER_DIR
        [--continuations ROWS --prompt-corpus FILE [--prompt-lens 16 192] [--row-len 320]] [--corpus FILE ...]
        [--prompts PROMPTS.npz [--new-tokens 128]] [--sliding-window W] [--train-windows W ...]
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
from lib.drafter_build import build_drafter
from lib.drafter_eval import (
    BestDrafter,
    acceptance_by_window,
    features_of,
    held_out_acceptance,
    mean_acceptance_length,
)
from lib.drafter_rows import Rows, load_rows, load_saved_rows, row_anchors, save_rows, step_batch
from lib.prompt_rows import prompt_file_rows
from lib.results import RESULTS_DIR, environment, write_results

from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.proposers.dflash.checkpoint import save_drafter
from kv_cache_proposer.proposers.dflash.training import block_loss


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
    p.add_argument("--prompts", type=Path, help="a prompt file (scripts/make_drafter_prompts.py): train on its prompts")
    p.add_argument("--new-tokens", type=int, default=128, help="with --prompts: most tokens continued per prompt")
    p.add_argument(
        "--batch-tokens", type=int, default=16384, help="with --prompts: most tokens (rows x longest) per batch"
    )
    p.add_argument("--generate-tokens", type=int, default=65536, help="with --prompts: most tokens per generate() call")
    p.add_argument(
        "--generate-seconds",
        type=float,
        default=0,
        help="with --prompts: continue training prompts (in a seeded random order) for at most this long (0: all)",
    )
    p.add_argument(
        "--generate-bf16",
        action="store_true",
        help="with --prompts: continue training prompts under bfloat16 autocast (held-out ones stay float32)",
    )
    p.add_argument(
        "--sliding-window", type=int, default=0, help="every drafter layer's window over the context (0: none)"
    )
    p.add_argument(
        "--train-windows",
        type=int,
        nargs="*",
        default=[],
        help="windows drawn per step while training (0: the whole context; default: --sliding-window alone)",
    )
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
    p.add_argument(
        "--stop-at",
        type=float,
        default=0,
        help="stop training by this Unix time, whatever --time-limit says (0: no such bound)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="train under bfloat16 autocast (the verifier's feature forward too); measurements stay float32",
    )
    p.add_argument("--init", type=Path, help="a drafter directory to start from (its weights; this run's config)")
    p.add_argument(
        "--tf32",
        action="store_true",
        help="on a CUDA device, train with TF32 matrix products (rows are generated in float32 before)",
    )
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    for name in ("row_len", "eval_prompt_len", "eval_prompts", "eval_tokens", "eval_every", "generate_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.sliding_window < 0 or any(w < 0 for w in args.train_windows):
        p.error("windows must be positive (0: the whole context)")
    if args.new_tokens < args.block_size:
        p.error("--new-tokens must be at least --block-size")
    low, high = args.prompt_lens
    if not 1 <= low <= high or high + args.block_size > args.row_len:
        p.error(f"--prompt-lens {low} {high} must satisfy 1 <= MIN <= MAX and MAX + --block-size <= --row-len")
    return args


def lr_at(step: int, args: argparse.Namespace, elapsed: float = 0.0) -> float:
    """Linear warm-up, then a cosine decay to zero at `--steps` or, sooner, at `--time-limit` seconds."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    if args.time_limit:
        progress = max(progress, elapsed / args.time_limit)
    return args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    verifier = TorchVerifier.load(args.model, device=args.device, dtype="float32")
    for parameter in verifier.model.parameters():
        parameter.requires_grad_(False)
    args.out.mkdir(parents=True, exist_ok=True)
    rows_file = args.out / "rows.npz"
    if args.resume and rows_file.exists():
        train, held, prompts = load_saved_rows(rows_file)
    else:
        train, held, prompts = prompt_file_rows(args, verifier) if args.prompts else load_rows(args, verifier)
        save_rows(rows_file, train, held, prompts)
    length = train.tokens.shape[1]
    if args.prompts:
        keep = train.scored()
        train = Rows(train.tokens[keep], train.first_anchor[keep], train.row_lengths()[keep])
        batches = train.batches(args.batch_tokens, args.batch_size)
    else:
        if int(train.first_anchor.max()) + args.block_size + args.anchors - 1 > length:
            raise SystemExit(
                f"rows of {length} tokens hold fewer than --anchors {args.anchors} blocks after the prompt"
            )
        batches = []

    if args.stop_at:  # the rows took what they took: training gets what is left
        left = max(1.0, args.stop_at - time.time())
        args.time_limit = min(args.time_limit or left, left)
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
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

    best = BestDrafter()
    started = time.perf_counter()
    with tqdm(range(start_step, args.steps), initial=start_step, total=args.steps, desc="train dflash") as bar:
        for step in bar:
            lengths = None
            if batches:
                chosen = batches[int(torch.randint(0, len(batches), (1,), generator=generator))]
                tokens, anchors, lengths = step_batch(train, chosen, args, generator)
                tokens = tokens.to(device)
            else:
                picks = torch.randint(0, len(train), (args.batch_size,), generator=generator).numpy()
                tokens = torch.from_numpy(train.tokens[picks]).to(device)
                anchors = row_anchors(train.first_anchor[picks], length, args, generator)
            windows = None
            if args.train_windows:
                drawn = args.train_windows[int(torch.randint(0, len(args.train_windows), (1,), generator=generator))]
                windows = [drawn or None] * len(drafter.layers)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, args, time.perf_counter() - started)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
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
                    lengths=lengths,
                    windows=windows,
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
                best.offer(step + 1, entry["heldout_acceptance_length"], drafter)
            history.append(entry)
            bar.set_postfix(loss=f"{float(stats.loss):.3f}", accept=f"{stats.acceptance_length:.2f}")
            if (step + 1) % args.save_every == 0:
                save_state(step + 1)
            if args.time_limit and time.perf_counter() - started > args.time_limit and step + 1 < args.steps:
                bar.write(f"--time-limit {args.time_limit:g} s reached after step {step + 1} of {args.steps}")
                break
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # measured in float32
    steps_done = history[-1]["step"] if history else start_step
    if history and "heldout_acceptance_length" not in history[-1]:
        history[-1]["heldout_acceptance_length"] = held_out_acceptance(drafter, spec, verifier, held, args)
        best.offer(steps_done, history[-1]["heldout_acceptance_length"], drafter)
    save_state(steps_done)
    train_seconds = time.perf_counter() - started
    kept_step = best.restore(drafter) or steps_done  # the drafter written is the best held-out one of this run

    drafter.eval()
    save_drafter(drafter, spec, args.out)
    evaluation = mean_acceptance_length(drafter, spec, verifier, prompts, args.eval_tokens)
    by_window = acceptance_by_window(drafter, spec, verifier, held, args) if args.prompts else []
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config.update(
        target_layer_ids=list(spec.target_layer_ids),
        mask_token_id=spec.mask_token_id,
        training_rows=len(train),
        row_len=length,
        training_tokens=int(train.row_lengths().sum()),
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
        "kept_step": kept_step,
        "kept_heldout_acceptance_length": best.acceptance,
        **evaluation,
    }
    if by_window:
        summary["heldout_acceptance_by_window"] = {
            str(w): float(np.mean([r["acceptance"] for r in by_window if r["window"] == w]))
            for w in sorted({r["window"] for r in by_window})
        }
    log = {
        "config": config,
        "environment": environment(),
        "summary": summary,
        "history": history,
        "acceptance_by_window": by_window,
    }
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
