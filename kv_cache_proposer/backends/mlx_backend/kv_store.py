"""Per-session K/V storage for the MLX backend, handed to mlx-lm's attention through its cache protocol.

The layout and semantics are those of the PyTorch store: each layer holds one buffer `[1, kv_heads, capacity,
head_dim]` whose slots are addressed by the strategy (`slot_of(position)`), plus a staging area for the block of
the forward in flight. `slot_positions[s]` is the global position stored in slot s (-1: empty). Attention reads
the slots and the stage together and the mask is built from their positions, so the physical slot order never
matters.

- `full`: slot = position and the stage sits right after the committed slots, so a commit moves nothing.
- `sink_window`: slots `[0, sink)` hold the sink, `[sink, sink + window)` are a ring for the window and the stage
  sits after the ring; a commit copies the accepted staged entries into their ring slots, overwriting evicted ones.
Either way, staged K/V of rejected drafts never overwrite a resident entry.

mlx-lm's models see one `StagingLayer` per layer: `offset` is the global position of the first token the model
call processes (the RoPE offset), `update_and_fetch` stages that call's K/V and returns everything its attention
reads, and `make_mask` returns the strategy's mask over those keys. One block may be staged by several model calls,
each processing a consecutive part of it (`select_queries`): a later part attends the earlier parts' staged K/V.
"""

from __future__ import annotations

from typing import Literal

import mlx.core as mx
import numpy as np

from kv_cache_proposer.backends.slots import PositionBookkeeping, check_resident, commit_targets
from kv_cache_proposer.errors import InvariantViolation
from kv_cache_proposer.strategies import KVStrategy

_GROWTH_TOKENS = 256

AttentionMask = mx.array | Literal["causal"] | None


class MlxSessionCache(PositionBookkeeping):
    """K/V buffers of one session, shared by every layer's slot table."""

    def __init__(self, strategy: KVStrategy, *, layer_windows: tuple[int | None, ...]) -> None:
        num_layers = len(layer_windows)
        self._strategy = strategy
        self._num_layers = num_layers
        self._next_position = 0
        self._keys: list[mx.array | None] = [None] * num_layers
        self._values: list[mx.array | None] = [None] * num_layers
        self._held: list[int] = [0] * num_layers  # resident entries per layer
        self._capacity = 0
        self._slot_positions = np.full((0,), -1, dtype=np.int64)
        self._stage_positions = np.empty(0, dtype=np.int64)
        self._key_positions = np.empty(0, dtype=np.int64)  # what attention reads in the model call in flight
        self._query_start = self._query_end = 0  # the part of the stage the model call in flight processes
        self._staged_counts = [0] * num_layers  # staged K/V written per layer for the block in flight
        self._released = False
        self.layers = [StagingLayer(self, i, window) for i, window in enumerate(layer_windows)]

    # -- SessionCache ------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        total = int(self._slot_positions.nbytes)
        for array in (*self._keys, *self._values):
            if array is not None:
                total += int(array.nbytes)
        return total

    @property
    def compressed_bytes(self) -> int:
        return 0

    def release(self) -> None:
        self._keys = [None] * self._num_layers
        self._values = [None] * self._num_layers
        self._slot_positions = np.full((0,), -1, dtype=np.int64)
        self._released = True

    def clone(self, length: int) -> MlxSessionCache:
        """An independent cache holding this cache's positions [0, length) as if only they had been committed.

        Every position the strategy keeps resident at `length` must still be resident here (a bounded cache may
        have evicted some); raises ValueError otherwise.
        """
        if self._released or not 0 <= length <= self._next_position:
            raise ValueError(f"cannot clone {length} positions of a cache holding {self._next_position}")
        twin = MlxSessionCache(self._strategy, layer_windows=tuple(layer._window for layer in self.layers))
        if length == 0:
            return twin
        slots, positions = commit_targets(self._strategy, 0, length)  # the resident set at `length`
        wanted = np.asarray(positions, dtype=np.int64)
        if not np.array_equal(self._slot_positions[slots], wanted):
            raise ValueError(f"positions below {length} were evicted; they cannot be cloned")
        capacity = max(slots) + 1
        twin._grow(capacity)
        index = mx.array(slots)
        for source, target in ((self._keys, twin._keys), (self._values, twin._values)):
            for i, buf in enumerate(source):
                if buf is not None:
                    copy = mx.zeros((*buf.shape[:2], capacity, buf.shape[3]), dtype=buf.dtype)
                    copy[:, :, index] = buf[:, :, index]  # [1, H, capacity, D]
                    target[i] = copy
        twin._slot_positions[slots] = wanted
        twin._held = [len(slots) if key is not None else 0 for key in twin._keys]
        twin._next_position = length
        mx.eval(twin.staged_arrays())
        twin.check_invariants()
        return twin

    # -- staging -----------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def stage_offset(self) -> int:
        """First slot of the stage; slots before it are read by attention together with the stage."""
        bounded = self._strategy.bounded_slots
        return self._next_position if bounded is None else bounded

    def begin_stage(self, block_len: int, *, extend: bool = False) -> list[StagingLayer]:
        """Reserve room for a block at the next positions; returns the per-layer caches of its model calls.

        The whole block is selected as the part the next model call processes. With `extend` the block goes after
        what the previous forward staged (and sees it); otherwise the previous stage is dropped.
        """
        if self._released:
            raise RuntimeError("the cache was released")
        kept = self._stage_positions.size if extend else 0
        needed = self.stage_offset + kept + block_len
        if needed > self._capacity:
            if self._strategy.bounded_slots is None:
                # Unbounded caches grow geometrically so appends stay amortised O(1).
                needed = max(needed, self._capacity + max(self._capacity // 2, _GROWTH_TOKENS))
            self._grow(needed)
        start = self._next_position + kept
        block = np.arange(start, start + block_len, dtype=np.int64)
        self._stage_positions = np.concatenate([self._stage_positions[:kept], block])
        if not extend:
            self._staged_counts = [0] * self._num_layers
        self.select_queries(kept, kept + block_len)
        return self.layers

    @property
    def block_start(self) -> int:
        """Index in the stage of the first position of the block in flight."""
        return self._query_start

    def select_queries(self, start: int, end: int) -> None:
        """Make block positions [start, end) the part the next model call processes; earlier parts stay staged."""
        if not 0 <= start < end <= self._stage_positions.size:
            raise ValueError(f"cannot select [{start}, {end}) of a block of {self._stage_positions.size}")
        self._query_start, self._query_end = start, end
        self._key_positions = np.concatenate([self._slot_positions[: self.stage_offset], self._stage_positions[:end]])

    @property
    def key_positions(self) -> np.ndarray:
        """Global positions of the keys the model call in flight reads (-1: an empty slot) [K]."""
        return self._key_positions

    @property
    def query_positions(self) -> np.ndarray:
        """Global positions of the queries of the model call in flight [n]."""
        return self._stage_positions[self._query_start : self._query_end]

    @property
    def query_offset(self) -> int:
        """Global position of the first token of the model call in flight."""
        return self._next_position + self._query_start

    def stage_layer(self, layer_idx: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write a layer's block K/V `[1, H, n, D]` into its stage; return the K/V attention reads `[1, H, K, D]`."""
        start, end = self._query_start, self._query_end
        if keys.shape[-2] != end - start:
            raise InvariantViolation(
                "inv1", f"layer {layer_idx} staged {keys.shape[-2]} K/V for a model call over {end - start} positions"
            )
        key_buf, value_buf = self._keys[layer_idx], self._values[layer_idx]
        if key_buf is None or value_buf is None:
            key_buf = mx.zeros((keys.shape[0], keys.shape[1], self._capacity, keys.shape[3]), dtype=keys.dtype)
            value_buf = mx.zeros((values.shape[0], values.shape[1], self._capacity, values.shape[3]), values.dtype)
        offset = self.stage_offset
        key_buf[:, :, offset + start : offset + end] = keys
        value_buf[:, :, offset + start : offset + end] = values
        self._keys[layer_idx], self._values[layer_idx] = key_buf, value_buf
        self._staged_counts[layer_idx] += end - start
        return key_buf[:, :, : offset + end], value_buf[:, :, : offset + end]

    def attention_mask(self, query_len: int, window: int | None, *, return_array: bool) -> AttentionMask:
        """Which keys of the model call in flight each of its queries may attend: `[n, K]` booleans, or mlx-lm's
        `None` / `"causal"` shorthands where those say the same (a `full` cache is laid out in position order)."""
        queries = self._stage_positions[self._query_start : self._query_end]
        if query_len != queries.size:
            raise InvariantViolation("inv1", f"a mask for {query_len} queries was asked for a call over {queries.size}")
        if self._strategy.bounded_slots is None and window is None and not return_array:
            return None if query_len == 1 else "causal"
        q = queries[:, None]  # [n, 1]
        k = self._key_positions[None, :]  # [1, K]
        allowed = (k >= 0) & (k <= q) & self._strategy.visible(q, k)  # [n, K]
        if window is not None:
            allowed &= q - k < window
        return mx.array(allowed)

    def staged_arrays(self) -> list[mx.array]:
        """Every K/V buffer, for evaluating a forward's writes together with its logits."""
        return [array for array in (*self._keys, *self._values) if array is not None]

    def commit(self, count: int) -> None:
        """Make the first `count` staged positions resident and drop the rest of the stage."""
        staged = self._stage_positions.size
        if not 0 <= count <= staged:
            raise ValueError(f"cannot commit {count} of {staged} staged positions")
        if count and any(written != staged for written in self._staged_counts):
            missing = [i for i, written in enumerate(self._staged_counts) if written != staged]
            raise InvariantViolation("inv1", f"layers {missing} did not receive the K/V of the whole block")
        offset = self.stage_offset
        start = self._next_position
        if self._strategy.bounded_slots is None:
            self._slot_positions[offset : offset + count] = self._stage_positions[:count]
            newly_held = count
        else:
            slots, sources = commit_targets(self._strategy, start, count)
            before = int((self._slot_positions[slots] >= 0).sum()) if slots else 0
            if slots:
                slot_idx = mx.array(slots)
                src_idx = mx.array(sources) + offset
                for buffers in (self._keys, self._values):
                    for i, buf in enumerate(buffers):
                        if buf is not None:
                            buf[:, :, slot_idx] = buf[:, :, src_idx]
                            buffers[i] = buf
                self._slot_positions[slots] = np.asarray(sources, dtype=np.int64) + start
            newly_held = len(slots) - before
        for layer_idx in range(self._num_layers):
            if self._keys[layer_idx] is not None:
                self._held[layer_idx] += newly_held
        self._next_position = start + count
        self._stage_positions = self._stage_positions[:0]
        self._key_positions = self._key_positions[:0]
        mx.eval(self.staged_arrays())
        self.check_invariants()

    def check_invariants(self) -> None:
        """INV-1: every layer holds exactly the strategy's resident count, as does the slot table."""
        held = [count if self._keys[i] is not None else None for i, count in enumerate(self._held)]
        check_resident(held, int((self._slot_positions >= 0).sum()), self.resident_count)

    def _grow(self, capacity: int) -> None:
        positions = np.full((capacity,), -1, dtype=np.int64)
        positions[: self._capacity] = self._slot_positions
        self._slot_positions = positions
        for buffers in (self._keys, self._values):
            for i, old in enumerate(buffers):
                if old is None:
                    continue
                extra = mx.zeros((*old.shape[:2], capacity - self._capacity, old.shape[3]), dtype=old.dtype)
                buffers[i] = mx.concatenate([old, extra], axis=2)
        self._capacity = capacity

    # -- inspection --------------------------------------------------------------------------------------------
    def resident_kv(self, layer_idx: int) -> tuple[mx.array, mx.array, np.ndarray]:
        """Resident (keys, values, positions) of one layer, ordered by position: `[1, H, R, D]` x2 and `[R]`."""
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        if keys is None or values is None:
            raise ValueError(f"layer {layer_idx} holds no K/V")
        positions = self._slot_positions[: self._capacity]
        slots = np.flatnonzero(positions >= 0)
        slots = slots[np.argsort(positions[slots], kind="stable")]
        index = mx.array(slots)
        return keys[:, :, index], values[:, :, index], positions[slots]


class StagingLayer:
    """One layer's view of a session cache, speaking mlx-lm's cache protocol to the model's attention."""

    def __init__(self, cache: MlxSessionCache, layer_idx: int, window: int | None) -> None:
        self._cache = cache
        self._layer_idx = layer_idx
        self._window = window

    @property
    def offset(self) -> int:
        """RoPE offset of the model call: the global position of its first token (evictions never shift it)."""
        return self._cache.query_offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._cache.stage_layer(self._layer_idx, keys, values)

    def make_mask(
        self, query_len: int, return_array: bool = False, window_size: int | None = None, **_: object
    ) -> AttentionMask:
        # A model that relies on its own rotating cache for a sliding window passes no window_size.
        window = window_size if window_size is not None else self._window
        return self._cache.attention_mask(query_len, window, return_array=return_array)

    @property
    def state(self) -> tuple[()]:
        return ()

    def is_trimmable(self) -> bool:
        return False

    def size(self) -> int:
        return self._cache.resident_count

    def empty(self) -> bool:
        return self._cache.next_position == 0

    @property
    def nbytes(self) -> int:
        return self._cache.nbytes
