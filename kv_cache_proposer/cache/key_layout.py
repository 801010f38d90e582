"""Keys in position order, each at a place that depends on its position alone: the layout in which an attention
that reads keys in whole blocks (`key_block` of them, under one running softmax) gives a query the same values
however the history around it was delivered (`KVSessionCache`'s `key_block`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kv_cache_proposer.cache.arrays import A, ArrayOps

Run = tuple[int, int, int]
"""Consecutive keys of a part copied to consecutive places: (first place, first key of the part, count)."""


class BlockedLayout:
    """The keys of one model call, read in parts (a restored prefix, the cache's slots), laid out by position:
    position p at `r·key_block + p mod key_block`, r the rank of its block `p // key_block` among the blocks that
    hold any of the keys. Places no key fills hold zeros, which the mask hides."""

    def __init__(self, parts: Sequence[np.ndarray], key_block: int) -> None:
        """`parts`: the positions of each part's keys in the order it holds them (−1: an empty slot); every
        position at most once."""
        sources = np.concatenate(parts) if len(parts) > 1 else parts[0]
        present = np.flatnonzero(sources >= 0)
        held = sources[present]
        blocks, rank = np.unique(held // key_block, return_inverse=True)
        places = rank * key_block + held % key_block
        self.positions = np.full(blocks.size * key_block, -1, dtype=np.int64)
        """The position at each place (−1: none); its length is a whole number of blocks."""
        self.positions[places] = held
        if np.count_nonzero(self.positions >= 0) != held.size:
            raise ValueError("a model call reads some position twice")
        self._runs: list[list[Run]] = []  # per part: a ring's window and a stage are a few runs each
        self._buffers: list[Any] = []  # K and V at their places, reused by every layer of the call
        start = 0
        for part in parts:
            mine = (present >= start) & (present < start + part.size)
            self._runs.append(_runs(places[mine], present[mine] - start))
            start += part.size

    def gather(self, ops: ArrayOps[A], parts: Sequence[tuple[A, A]]) -> tuple[A, A]:
        """The dense `parts`' keys and values `[B, H, c, D]` at their places: one copy of each read key, into two
        buffers that every layer of the call reuses (a layer's attention has read them before the next layer
        stages; the places no key fills stay zero)."""
        if not self._buffers:
            self._buffers = [ops.alloc(parts[0][index], self.positions.size) for index in (0, 1)]
        laid: list[A] = []
        for index in (0, 1):
            out: A = self._buffers[index]
            for part, runs in zip(parts, self._runs, strict=True):
                for place, key, count in runs:
                    out = ops.write(out, place, ops.span(part[index], key, key + count))
            laid.append(out)
        return laid[0], laid[1]


def _runs(places: np.ndarray, keys: np.ndarray) -> list[Run]:
    """`places[i]` ← `keys[i]` as runs of consecutive places and keys."""
    if not places.size:
        return []
    breaks = np.flatnonzero((np.diff(places) != 1) | (np.diff(keys) != 1)) + 1
    starts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [places.size]])
    return [(int(places[a]), int(keys[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]
