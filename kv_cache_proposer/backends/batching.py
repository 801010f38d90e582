"""Several sessions' blocks in one model call, each over its own session cache, written once for every backend.

A batched forward lays the rows' queries out along the model call in one of two ways:

- packed: one sequence holding the rows' blocks one after another (batch 1). Attention reads each row's keys
  over that row's queries (`stage_layer_rows`: torch's direct forward), or every row's keys side by side under a
  block-diagonal mask that keeps each row to its own (`stage_layer`: transformers' modules). No padding; needs
  per-token positions (torch's `position_ids`).
- padded: one batch row per block, left-padded to the longest block. Each row's keys are left-padded to the
  longest key set. Needs only a per-row RoPE offset (mlx-lm's `cache.offset` may be one per row). Padded queries
  read their row's last key so that no softmax row is empty; their outputs are never used.

Per layer, `stage_layer` hands each row's new K/V to its own cache (which stages them exactly as a forward of that
row alone would) and joins what the rows' attention reads. Masks come from `visible_keys` per row, so every row
keeps its own KV strategy, positions and sliding window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic

import numpy as np

from kv_cache_proposer.cache import visible_keys
from kv_cache_proposer.cache.arrays import A, ArrayOps
from kv_cache_proposer.cache.protocol import KeyPart
from kv_cache_proposer.errors import InvariantViolation
from kv_cache_proposer.verifier import BatchBlock


@dataclass(frozen=True, slots=True)
class RowKeys(Generic[A]):
    """What one row of a packed batched forward reads: its queries `[query_start, query_end)` of the call, and its
    keys, from `key_start` of the joined keys, in parts."""

    query_start: int
    query_end: int
    key_start: int
    parts: tuple[KeyPart[A], ...]


class BatchLayout(Generic[A]):
    """Where each row's queries and keys sit in one batched model call, and the per-layer staging over it.

    The rows' stages must have begun (`begin_stage`) before the layout is built.
    """

    def __init__(
        self,
        blocks: Sequence[BatchBlock[A]],
        ops: ArrayOps[A],
        *,
        packed: bool,
        join_batch: Callable[[list[A]], A] | None = None,
    ) -> None:
        if not blocks:
            raise ValueError("a batched forward needs at least one block")
        if not packed and join_batch is None:
            raise ValueError("a padded layout needs join_batch")
        self.blocks = list(blocks)
        self.packed = packed
        self._ops = ops
        self._join_batch = join_batch
        self.lengths = [len(block.token_ids) for block in blocks]
        self._key_counts = [int(block.cache.call.key_positions.size) for block in blocks]
        for block, length in zip(blocks, self.lengths, strict=True):
            if block.cache.call.query_positions.size != length:
                raise InvariantViolation(
                    "inv1", f"a block of {length} tokens met a stage of {block.cache.call.query_positions.size} queries"
                )
        if packed:
            self.width = sum(self.lengths)
            self.query_starts = [int(s) for s in np.cumsum([0, *self.lengths[:-1]])]
            self.key_width = sum(self._key_counts)
            self._key_starts = [int(s) for s in np.cumsum([0, *self._key_counts[:-1]])]
        else:
            self.width = max(self.lengths)
            self.query_starts = [self.width - length for length in self.lengths]
            self.key_width = max(self._key_counts)
            self._key_starts = [self.key_width - count for count in self._key_counts]

    @property
    def num_layers(self) -> int:
        return self.blocks[0].cache.num_layers

    @property
    def keys_before_queries(self) -> int:
        """Keys attention reads beyond the call's own queries (what a library adds to the query length)."""
        return self.key_width - self.width

    @property
    def own_keys(self) -> int:
        """0: `keys_before_queries` counts every key beyond the queries, the rows' own keys included."""
        return 0

    @property
    def rows(self) -> int:
        """Batch rows of the model call: 1 when packed."""
        return 1 if self.packed else len(self.blocks)

    def token_matrix(self, pad_token: int = 0) -> list[list[int]]:
        """Input ids `[rows, width]`."""
        if self.packed:
            return [[token for block in self.blocks for token in block.token_ids]]
        starts = self.query_starts
        return [[pad_token] * start + list(block.token_ids) for block, start in zip(self.blocks, starts, strict=True)]

    def position_matrix(self) -> np.ndarray:
        """Global position of every query `[rows, width]` (padded queries sit before their row's first one)."""
        if self.packed:
            return np.concatenate([block.cache.call.query_positions for block in self.blocks])[None, :]
        out = np.empty((len(self.blocks), self.width), dtype=np.int64)
        for row, (block, start) in enumerate(zip(self.blocks, self.query_starts, strict=True)):
            first = int(block.cache.call.query_offset)
            out[row] = np.arange(first - start, first - start + self.width)
        return out

    def query_span(self, index: int) -> tuple[int, int, int]:
        """(batch row, first query, end) of block `index` along the model call's query axis."""
        start = self.query_starts[index]
        return (0 if self.packed else index), start, start + self.lengths[index]

    def logits_indices(self) -> list[int]:
        """Query indices (packed) whose logits the rows want, in row order."""
        out: list[int] = []
        for index, block in enumerate(self.blocks):
            _, _, end = self.query_span(index)
            out.extend(range(end - block.logits_rows, end))
        return out

    def mask(self, window: int | None = None, *, causal: bool = True) -> np.ndarray:
        """Booleans `[rows, width, key_width]`: which keys each query reads (`window`: a sliding-window layer;
        `causal=False`: a block reads all of itself, as a drafter's block does)."""
        mask = np.zeros((self.rows, self.width, self.key_width), dtype=bool)
        for index, block in enumerate(self.blocks):
            cache = block.cache
            allowed = visible_keys(
                cache.strategy,
                cache.call.query_positions,
                cache.call.key_positions,
                causal=causal,
                window=window,
                own_keys=cache.call.own_keys,
            )
            row, start, end = self.query_span(index)
            key_start = self._key_starts[index]
            mask[row, start:end, key_start : key_start + self._key_counts[index]] = allowed
            if not self.packed and start:
                mask[row, :start, self.key_width - 1] = True  # padded queries read one real key
        return mask

    def stage_layer_rows(self, layer_idx: int, keys: A, values: A) -> list[RowKeys[A]]:
        """Stage each row's K/V `[1, H, width, D]` of a packed layout in its cache; returns what each row's attention
        reads, in parts (`SessionCache.stage_layer_parts`), with where the row's queries and keys sit."""
        if not self.packed:
            raise ValueError("rows read in parts only from a packed layout")
        ops = self._ops
        rows = []
        for index, block in enumerate(self.blocks):
            _, start, end = self.query_span(index)
            parts = block.cache.stage_layer_parts(layer_idx, ops.span(keys, start, end), ops.span(values, start, end))
            rows.append(RowKeys(start, end, self._key_starts[index], parts))
        return rows

    def stage_layer(self, layer_idx: int, keys: A, values: A) -> tuple[A, A]:
        """Stage each row's K/V `[rows, H, width, D]` in its cache; returns what attention reads
        `[rows, H, key_width, D]`."""
        all_keys: list[A] = []
        all_values: list[A] = []
        source_keys: Any = keys
        source_values: Any = values
        for index, block in enumerate(self.blocks):
            row, start, end = self.query_span(index)
            row_keys, row_values = block.cache.stage_layer(
                layer_idx, source_keys[row : row + 1, :, start:end], source_values[row : row + 1, :, start:end]
            )
            if not self.packed and self._key_starts[index]:
                pad = self._ops.alloc(row_keys, self._key_starts[index])
                row_keys, row_values = self._ops.concat([pad, row_keys]), self._ops.concat([pad, row_values])
            all_keys.append(row_keys)
            all_values.append(row_values)
        if self.packed:
            return self._ops.concat(all_keys), self._ops.concat(all_values)
        assert self._join_batch is not None
        return self._join_batch(all_keys), self._join_batch(all_values)
