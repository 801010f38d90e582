"""Training rows of a DFlash drafter: the verifier's own continuations of prompts, and plain text rows.

A row is token ids with the first position a block may be anchored at: after the prompt for a continuation (what
the drafter is asked to predict when serving), anywhere for plain text. Rows cut from a corpus all hold `row_len`
tokens; continuations of a prompt file (`lib.prompt_rows`) are as long as their prompt plus what the verifier said
before its end-of-turn token, right-padded, with each row's real length kept.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.proposers.dflash.training import sample_anchors
from lib.tokens import read_tokens, spread_windows


@dataclass
class Rows:
    """Training rows [R, L] (right-padded), per row the first position a block may be anchored at [R], and per row
    its real length [R] (None: every row is L long)."""

    tokens: np.ndarray
    first_anchor: np.ndarray
    lengths: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def row_lengths(self) -> np.ndarray:
        return np.full(len(self), self.tokens.shape[1]) if self.lengths is None else self.lengths

    @staticmethod
    def concat(parts: list[Rows]) -> Rows:
        width = max(r.tokens.shape[1] for r in parts)
        padded = [np.pad(r.tokens, ((0, 0), (0, width - r.tokens.shape[1]))) for r in parts]
        ragged = any(r.lengths is not None for r in parts) or len({r.tokens.shape[1] for r in parts}) > 1
        return Rows(
            np.concatenate(padded),
            np.concatenate([r.first_anchor for r in parts]),
            np.concatenate([r.row_lengths() for r in parts]) if ragged else None,
        )

    def scored(self) -> np.ndarray:
        """Indices of the rows with at least one block slot to score after their first anchor."""
        return np.flatnonzero(self.row_lengths() - self.first_anchor >= 2)

    def batches(self, token_budget: int, max_rows: int) -> list[np.ndarray]:
        """Row indices grouped by length, each group's rows x longest row within `token_budget` (and at most
        `max_rows` rows), so a step over a group pads little."""
        lengths = self.row_lengths()
        groups: list[np.ndarray] = []
        current: list[int] = []
        for index in np.argsort(lengths, kind="stable"):
            longest = int(lengths[index])
            if current and ((len(current) + 1) * longest > token_budget or len(current) == max_rows):
                groups.append(np.asarray(current))
                current = []
            current.append(int(index))
        if current:
            groups.append(np.asarray(current))
        return groups


def flatten(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of ragged prompts end to end (int32) and the offsets where each starts, plus the end."""
    ids = np.concatenate([np.asarray(p, dtype=np.int32) for p in prompts]) if prompts else np.zeros(0)
    return ids.astype(np.int32), np.cumsum([0, *(len(p) for p in prompts)]).astype(np.int64)


def unflatten(ids: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    """The prompts `flatten` joined."""
    return [ids[a:b].astype(np.int64).tolist() for a, b in pairwise(offsets)]


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


def row_anchors(first: np.ndarray, length: int, args: argparse.Namespace, generator: torch.Generator) -> torch.Tensor:
    """`--anchors` anchors per row at or after the row's first anchor position [N, A]."""
    return torch.stack([sample_anchors(length, args.block_size, args.anchors, generator, first=int(f)) for f in first])


def step_batch(
    train: Rows, group: np.ndarray, args: argparse.Namespace, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [N, longest + block size], anchors [N, A], lengths [N]) of one step over the rows `group`."""
    lengths = train.row_lengths()[group]
    width = int(lengths.max()) + args.block_size
    tokens = np.zeros((len(group), width), dtype=np.int64)
    anchors = []
    for row, index in enumerate(group):
        length, first = int(lengths[row]), int(train.first_anchor[index])
        tokens[row, : min(width, train.tokens.shape[1])] = train.tokens[index, :width]
        if length - args.block_size - first + 1 >= args.anchors:  # distinct anchors, every block whole
            anchors.append(sample_anchors(length, args.block_size, args.anchors, generator, first=first))
        else:  # a short continuation: anchors may repeat, and a block's slots past the row's end are not scored
            anchors.append(torch.randint(first, length - 1, (args.anchors,), generator=generator).sort().values)
    return torch.from_numpy(tokens), torch.stack(anchors), torch.from_numpy(lengths.astype(np.int64))


def save_rows(path: Path, train: Rows, held: Rows, prompts: list[list[int]]) -> None:
    """Write a run's rows and final-check prompts, so a resumed run (or another machine) skips generating them."""
    ids, offsets = flatten(prompts)
    np.savez_compressed(  # token ids fit int32: a quarter of the int64 size before compression
        path,
        train=train.tokens.astype(np.int32),
        train_first=train.first_anchor,
        train_lengths=train.row_lengths(),
        held=held.tokens.astype(np.int32),
        held_first=held.first_anchor,
        held_lengths=held.row_lengths(),
        prompts=ids,
        prompt_offsets=offsets,
    )


def load_saved_rows(path: Path) -> tuple[Rows, Rows, list[list[int]]]:
    """What `save_rows` wrote."""
    saved = np.load(path)
    train = Rows(saved["train"].astype(np.int64), saved["train_first"], saved["train_lengths"])
    held = Rows(saved["held"].astype(np.int64), saved["held_first"], saved["held_lengths"])
    return train, held, unflatten(saved["prompts"], saved["prompt_offsets"])
