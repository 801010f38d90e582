"""Token-id corpora for the scripts: reading them, and cutting evenly spread prompt windows from them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lib.corpus import read_text


def read_tokens(path: Path, model: Path) -> np.ndarray:
    """Token ids of a `.npy` file (1-D integers), or of a text file tokenized with `model`'s tokenizer."""
    if path.suffix == ".npy":
        return np.load(path).astype(np.int64).reshape(-1)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    return np.asarray(tokenizer.encode(read_text(path)), dtype=np.int64)


def spread_windows(ids: np.ndarray, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens spread evenly over `ids`, from its start to its end."""
    starts = np.linspace(0, len(ids) - length, count).astype(int)
    return [[int(t) for t in ids[s : s + length]] for s in starts]


def shared_prefix(tokens: list[int], others: list[int]) -> int:
    """How many leading tokens two decodings share."""
    same = 0
    for token, other in zip(tokens, others, strict=False):
        if token != other:
            break
        same += 1
    return same
