"""Write the prompts a DFlash drafter is trained and measured on (a prompt file for `train_dflash.py --prompts`).

Two sources, both cut from the offline corpus (the standard library's source), training prompts from its training
files and held-out prompts from its held-out files:
- `--chat`: chat-formatted prompts in the model's own chat template (questions, multi-turn chats, code, JSON tool
  calls, and long documents with a question of log-uniform lengths up to `--document-lengths MAX`): for an
  instruct model;
- `--slices`: slices of the corpus text of log-uniform lengths (`--slice-lengths`): for a base model.

The file is built on the machine that measures the drafter, so its held-out split is that machine's corpus; it
travels to wherever the drafter is trained.

Usage:
    python scripts/make_drafter_prompts.py --model MODEL --out PROMPTS.npz --chat 1600 --held 96
    python scripts/make_drafter_prompts.py --model kakeya-tiny --out PROMPTS.npz --slices 4000 --held 64
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.chat_prompts import KINDS, ChatPromptBuilder, chat_prompts
from lib.corpus import read_text, split_sources, stdlib_sources
from lib.model_option import add_model_option
from lib.prompt_rows import PromptSet

# Shares of the chat kinds: documents carry the long prompts.
CHAT_MIX = {"question": 0.2, "multi_turn": 0.15, "code": 0.2, "tool_call": 0.15, "document": 0.3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(p)
    p.add_argument("--out", required=True, type=Path, help="the prompt file to write (.npz)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--chat", type=int, help="chat-formatted training prompts to write")
    source.add_argument("--slices", type=int, help="corpus slices to write as training prompts")
    p.add_argument("--held", type=int, default=64, help="held-out prompts to write")
    p.add_argument(
        "--document-lengths", type=int, nargs=2, default=[256, 8000], metavar=("MIN", "MAX"), help="chat documents"
    )
    p.add_argument(
        "--slice-lengths", type=int, nargs=2, default=[16, 8000], metavar=("MIN", "MAX"), help="corpus slices"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for low, high in (args.document_lengths, args.slice_lengths):
        if not 1 <= low <= high:
            p.error("a length range must satisfy 1 <= MIN <= MAX")
    if (args.chat or args.slices or 0) < 1 or args.held < 1:
        p.error("--chat / --slices and --held must be at least 1")
    return args


Prompts = tuple[list[list[int]], list[str]]  # token ids and kind of each prompt


def chat_set(builder: ChatPromptBuilder, count: int, seed: int, document_range: tuple[int, int]) -> Prompts:
    counts = {kind: math.ceil(count * CHAT_MIX[kind]) for kind in KINDS}
    prompts = chat_prompts(builder, counts, seed=seed, document_range=document_range)
    return [p.tokens for p in prompts], [p.kind for p in prompts]


def corpus_ids(tokenizer: Any, paths: list[Path], tokens: int, rng: random.Random) -> np.ndarray:
    """Token ids of randomly ordered corpus files, until `tokens`."""
    order = list(paths)
    rng.shuffle(order)
    ids: list[int] = []
    for path in order:
        ids += tokenizer.encode(read_text(path), add_special_tokens=False)
        if len(ids) >= tokens:
            break
    return np.asarray(ids, dtype=np.int64)


def slice_set(ids: np.ndarray, count: int, low: int, high: int, rng: random.Random) -> Prompts:
    high = min(high, len(ids) - 1)
    prompts = []
    for _ in range(count):
        length = round(math.exp(rng.uniform(math.log(low), math.log(max(low, high)))))
        start = rng.randrange(0, len(ids) - length)
        prompts.append(ids[start : start + length].tolist())
    return prompts, ["slice"] * count


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    model = args.model
    tokenizer: Any = AutoTokenizer.from_pretrained(model, local_files_only=True)
    train_files, held_files = split_sources(stdlib_sources())
    rng = random.Random(args.seed)
    if args.chat:
        low, high = args.document_lengths
        train = chat_set(ChatPromptBuilder(tokenizer, train_files), args.chat, args.seed, (low, high))
        held = chat_set(ChatPromptBuilder(tokenizer, held_files), args.held, args.seed + 1, (low, high))
    else:
        low, high = args.slice_lengths
        budget = max(2 * high, 400 * args.slices)
        train = slice_set(corpus_ids(tokenizer, train_files, budget, rng), args.slices, low, high, rng)
        held = slice_set(corpus_ids(tokenizer, held_files, 4 * high, rng), args.held, low, high, rng)
    PromptSet(train[0], train[1], held[0], held[1]).save(args.out)
    lengths = [len(p) for p in train[0]]
    print(
        f"wrote {args.out}: {len(train[0])} training prompts ({sum(lengths)} tokens, "
        f"{min(lengths)}..{max(lengths)} each) and {len(held[0])} held-out prompts"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
