"""Training rows of a DFlash drafter from a prompt file (`scripts/make_drafter_prompts.py`): each prompt followed by
the verifier's own greedy continuation, up to its end-of-turn token, generated for all prompts or within a time
bound."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from lib.drafter_rows import Rows, flatten, unflatten

# Prompts continued between two looks at the clock of `--generate-seconds`.
GENERATE_CHUNK = 2048


@dataclass(frozen=True)
class PromptSet:
    """Prompts of a drafter's training (`train`) and measurement (`held`): token ids and a kind per prompt."""

    train: list[list[int]]
    train_kinds: list[str]
    held: list[list[int]]
    held_kinds: list[str]

    def save(self, path: Path) -> None:
        train_ids, train_offsets = flatten(self.train)
        held_ids, held_offsets = flatten(self.held)
        np.savez_compressed(
            path,
            train_ids=train_ids,
            train_offsets=train_offsets,
            train_kinds=np.asarray(self.train_kinds),
            held_ids=held_ids,
            held_offsets=held_offsets,
            held_kinds=np.asarray(self.held_kinds),
        )

    @staticmethod
    def load(path: Path) -> PromptSet:
        saved = np.load(path)
        return PromptSet(
            unflatten(saved["train_ids"], saved["train_offsets"]),
            [str(k) for k in saved["train_kinds"]],
            unflatten(saved["held_ids"], saved["held_offsets"]),
            [str(k) for k in saved["held_kinds"]],
        )


def prompt_continuations(
    verifier: TorchVerifier,
    prompts: Sequence[list[int]],
    *,
    new_tokens: int,
    stop_ids: Sequence[int],
    token_budget: int,
    max_rows: int,
    desc: str,
    bf16: bool = False,
) -> Rows:
    """Each prompt followed by the verifier's greedy continuation: up to `new_tokens` tokens, ending with the first
    of `stop_ids` it says. Prompts of similar length are generated together, left-padded under an attention mask
    (whose arithmetic may differ from one prompt alone in the last bits: a rare token of a row may then differ from
    what the prompt alone gives). `bf16` generates under bfloat16 autocast: several times faster on a GPU, and a
    near-tie may then go the other way than in float32."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    rows: list[list[int] | None] = [None] * len(prompts)
    stops = set(int(t) for t in stop_ids)
    with tqdm(total=len(prompts), desc=desc, unit="row") as bar:
        begin = 0
        while begin < len(order):
            end = begin + 1
            while end < len(order) and end - begin < max_rows:
                if (end - begin + 1) * (len(prompts[order[end]]) + new_tokens) > token_budget:
                    break
                end += 1
            group = [prompts[i] for i in order[begin:end]]
            width = max(len(p) for p in group)
            ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in group], device=verifier.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=verifier.device)
            with torch.no_grad(), torch.autocast(verifier.device.type, dtype=torch.bfloat16, enabled=bf16):
                out = verifier.model.generate(  # type: ignore[operator]
                    ids,
                    attention_mask=mask,
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    eos_token_id=sorted(stops) or None,
                    pad_token_id=0,
                )
            for index, prompt, generated in zip(order[begin:end], group, out[:, width:].tolist(), strict=True):
                said: list[int] = []
                for token in generated:
                    said.append(int(token))
                    if token in stops:
                        break
                rows[index] = [*prompt, *said]
            bar.update(end - begin)
            begin = end
    lengths = np.asarray([len(r) for r in rows if r is not None])
    tokens = np.zeros((len(rows), int(lengths.max())), dtype=np.int64)
    for index, row in enumerate(rows):
        assert row is not None
        tokens[index, : len(row)] = row
    return Rows(tokens, np.asarray([len(p) for p in prompts], dtype=np.int64), lengths)


def stop_token_ids(model: Path) -> list[int]:
    """The verifier's end-of-turn tokens: the `eos_token_id` of its generation config and config, and its
    tokenizer's (where it has one)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        if (model / name).is_file():
            eos = json.loads((model / name).read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else eos or [])
    if (model / "tokenizer.json").is_file() or (model / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def prompt_file_rows(args: argparse.Namespace, verifier: TorchVerifier) -> tuple[Rows, Rows, list[list[int]]]:
    """(training rows, held-out rows, held-out prompts of the final check) of a `--prompts` file."""
    prompts = PromptSet.load(args.prompts)
    if not prompts.train or not prompts.held:
        raise SystemExit(f"{args.prompts} holds no training or no held-out prompts")
    stops = stop_token_ids(args.model)

    def rows(chosen: list[list[int]], desc: str, bf16: bool = False) -> Rows:
        return prompt_continuations(
            verifier,
            chosen,
            new_tokens=args.new_tokens,
            stop_ids=stops,
            token_budget=args.generate_tokens,
            max_rows=args.generate_batch,
            desc=desc,
            bf16=bf16,
        )

    spread = np.linspace(0, len(prompts.held) - 1, min(args.eval_rows, len(prompts.held))).astype(int)
    held = rows([prompts.held[i] for i in spread], "held-out continuations")
    final = np.linspace(0, len(prompts.held) - 1, min(args.eval_prompts, len(prompts.held))).astype(int)
    train = rows_within(
        args.generate_seconds, prompts.train, lambda chosen, desc: rows(chosen, desc, args.generate_bf16), args.seed
    )
    return train, held, [prompts.held[i] for i in final]


def rows_within(
    seconds: float, prompts: list[list[int]], rows: Callable[[list[list[int]], str], Rows], seed: int
) -> Rows:
    """Continuations of `prompts`, all of them (`seconds` 0) or as many as `seconds` allow: then the prompts are
    taken in a seeded random order, chunk by chunk, so a run cut short still holds prompts of every length (rows of
    one `generate` call are of similar length)."""
    if not seconds:
        return rows(prompts, "continuations")
    started = time.monotonic()
    order = np.random.default_rng(seed).permutation(len(prompts))
    parts: list[Rows] = []
    for begin in range(0, len(order), GENERATE_CHUNK):
        if parts and time.monotonic() - started >= seconds:
            break
        chunk = [prompts[i] for i in order[begin : begin + GENERATE_CHUNK]]
        parts.append(rows(chunk, f"continuations {begin + len(chunk)}/{len(prompts)}"))
    done = Rows.concat(parts)
    new = int((done.row_lengths() - done.first_anchor).sum())
    print(
        f"continued {len(done)} of {len(prompts)} prompts ({int(done.first_anchor.sum())} prompt tokens, {new} new) "
        f"in {time.monotonic() - started:.0f} s (--generate-seconds {seconds:g})",
        flush=True,
    )
    return done
