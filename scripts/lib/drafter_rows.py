"""Training rows of a DFlash drafter: the verifier's own continuations of prompt slices, and plain text rows.

A row is `row_len` token ids with the first position a block may be anchored at: after the prompt for a
continuation (what the drafter is asked to predict when serving), anywhere for plain text.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from lib.tokens import read_tokens, spread_windows


@dataclass
class Rows:
    """Training rows [R, L] and, per row, the first position a block may be anchored at [R]."""

    tokens: np.ndarray
    first_anchor: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def concat(parts: list[Rows]) -> Rows:
        return Rows(np.concatenate([r.tokens for r in parts]), np.concatenate([r.first_anchor for r in parts]))


def plain_rows(ids: np.ndarray, row_len: int) -> Rows:
    count = len(ids) // row_len
    return Rows(ids[: count * row_len].reshape(count, row_len).astype(np.int64), np.ones(count, dtype=np.int64))


def continuations(
    verifier: TorchVerifier,
    seeds: np.ndarray,
    rows: int,
    args: argparse.Namespace,
    generator: np.random.Generator,
    *,
    prompt_lens: tuple[int, int],
    row_len: int,
    desc: str,
) -> Rows:
    """`rows` rows of `row_len` tokens: a slice of `seeds` as the prompt, then the verifier's continuation."""
    sampling = {"do_sample": True, "temperature": args.generate_temperature} if args.generate_temperature else {}
    tokens: list[np.ndarray] = []
    firsts: list[np.ndarray] = []
    done = 0
    with tqdm(total=rows, desc=desc, unit="row") as bar:
        while done < rows:
            batch = min(args.generate_batch, rows - done)
            prompt_len = int(generator.integers(prompt_lens[0], prompt_lens[1] + 1))
            if len(seeds) <= prompt_len:
                raise SystemExit(f"the prompt text holds {len(seeds)} tokens, not more than a prompt of {prompt_len}")
            starts = generator.integers(0, len(seeds) - prompt_len, batch)
            prompts = torch.from_numpy(np.stack([seeds[s : s + prompt_len] for s in starts])).to(verifier.device)
            with torch.no_grad():
                out = verifier.model.generate(  # type: ignore[operator]
                    prompts,
                    attention_mask=torch.ones_like(prompts),
                    max_new_tokens=row_len - prompt_len,
                    min_new_tokens=row_len - prompt_len,
                    pad_token_id=0,
                    **sampling,
                )
            tokens.append(out.cpu().numpy().astype(np.int64))
            firsts.append(np.full(batch, prompt_len, dtype=np.int64))
            done += batch
            bar.update(batch)
    return Rows(np.concatenate(tokens), np.concatenate(firsts))


def load_rows(args: argparse.Namespace, verifier: TorchVerifier) -> tuple[Rows, Rows, list[list[int]]]:
    """(training rows, held-out continuation rows, held-out prompts of the final check)."""
    generator = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    plain = [read_tokens(path, args.model) for path in args.corpus]
    seeds = read_tokens(args.prompt_corpus, args.model) if args.prompt_corpus else None
    if args.eval_corpus is not None:
        held = read_tokens(args.eval_corpus, args.model)
    else:  # hold out the tail of the prompt text (or of the corpus), never trained on
        source = seeds if seeds is not None else (np.concatenate(plain) if plain else None)
        if source is None:
            raise SystemExit("no text: give --corpus and/or --continuations with --prompt-corpus")
        cut = len(source) - max(args.eval_prompt_len * args.eval_prompts, int(len(source) * args.holdout_fraction))
        held = source[cut:]
        if seeds is not None:
            seeds = source[:cut]
        else:
            plain = [source[:cut]]
    if seeds is None and plain:
        seeds = np.concatenate(plain)
    if len(held) < args.eval_prompt_len:
        raise SystemExit(
            f"the evaluation text holds {len(held)} tokens, fewer than --eval-prompt-len {args.eval_prompt_len}"
        )
    parts = [plain_rows(ids, args.row_len) for ids in plain]
    if args.continuations:
        if seeds is None:
            raise SystemExit("--continuations needs --prompt-corpus or --corpus to cut prompts from")
        if len(seeds) <= args.prompt_lens[1]:
            raise SystemExit(
                f"the prompt text holds {len(seeds)} tokens, not more than --prompt-lens MAX {args.prompt_lens[1]}"
            )
        lens = (args.prompt_lens[0], args.prompt_lens[1])
        parts.append(
            continuations(
                verifier,
                seeds,
                args.continuations,
                args,
                generator,
                prompt_lens=lens,
                row_len=args.row_len,
                desc="continuations",
            )
        )
    parts = [p for p in parts if len(p)]
    if not parts:
        raise SystemExit("no training rows: give --corpus files and/or --continuations N")
    eval_len = args.eval_prompt_len
    held_rows = continuations(
        verifier,
        held,
        args.eval_rows,
        args,
        generator,
        prompt_lens=(eval_len, eval_len),
        row_len=eval_len + max(args.eval_tokens, args.block_size),
        desc="held-out continuations",
    )
    return Rows.concat(parts), held_rows, spread_windows(held, args.eval_prompts, eval_len)
