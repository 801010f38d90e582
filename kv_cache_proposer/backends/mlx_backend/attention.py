"""Handing a session cache to mlx-lm's attention through its cache protocol.

mlx-lm's models see one `StagingLayer` per layer: `offset` is the global position of the first token the model
call processes (the RoPE offset), `update_and_fetch` stages that call's K/V in the session cache and returns
everything its attention reads, and `make_mask` returns the strategy's mask over those keys.
"""

from __future__ import annotations

from typing import Literal

import mlx.core as mx

from kv_cache_proposer.backends.batching import BatchLayout
from kv_cache_proposer.cache import SessionCache, visible_keys
from kv_cache_proposer.errors import InvariantViolation

AttentionMask = mx.array | Literal["causal"] | None


class StagingLayer:
    """One layer's view of a session cache, speaking mlx-lm's cache protocol to the model's attention."""

    def __init__(self, cache: SessionCache[mx.array], layer_idx: int, window: int | None) -> None:
        self._cache = cache
        self._layer_idx = layer_idx
        self._window = window

    @property
    def offset(self) -> int:
        """RoPE offset of the model call: the global position of its first token (evictions never shift it)."""
        return self._cache.call.query_offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._cache.stage_layer(self._layer_idx, keys, values)

    def make_mask(
        self, query_len: int, return_array: bool = False, window_size: int | None = None, **_: object
    ) -> AttentionMask:
        # A model that relies on its own rotating cache for a sliding window passes no window_size.
        window = window_size if window_size is not None else self._window
        return attention_mask(self._cache, query_len, window, return_array=return_array)

    @property
    def state(self) -> tuple[()]:
        return ()

    def is_trimmable(self) -> bool:
        return False

    def size(self) -> int:
        return self._cache.footprint().resident_count

    def empty(self) -> bool:
        return self._cache.next_position == 0

    @property
    def nbytes(self) -> int:
        return self._cache.footprint().nbytes


def attention_mask(
    cache: SessionCache[mx.array], query_len: int, window: int | None, *, return_array: bool
) -> AttentionMask:
    """Which keys of the model call in flight each of its queries may attend: `[n, K]` booleans, or mlx-lm's
    `None` / `"causal"` shorthands where those say the same (an unbounded cache read alone is in position order)."""
    call = cache.call
    queries = call.query_positions
    if query_len != queries.size:
        raise InvariantViolation("inv1", f"a mask for {query_len} queries was asked for a call over {queries.size}")
    own = call.own_keys
    if cache.strategy.bounded_slots is None and call.prefix_keys == 0 and window is None and not (own or return_array):
        return None if query_len == 1 else "causal"
    return mx.array(visible_keys(cache.strategy, queries, call.key_positions, window=window, own_keys=own))


def staging_layers(cache: SessionCache[mx.array], layer_windows: tuple[int | None, ...]) -> list[StagingLayer]:
    """The per-layer cache objects of one forward's model calls."""
    return [StagingLayer(cache, i, window) for i, window in enumerate(layer_windows)]


class BatchStagingLayer:
    """One layer's view of a padded batched forward (`BatchLayout`): per-row RoPE offsets, each row's K/V staged in
    its own session cache, and a `[B, 1, T, K]` mask from each row's own strategy."""

    def __init__(self, layout: BatchLayout[mx.array], offsets: mx.array, layer_idx: int, window: int | None) -> None:
        self._layout = layout
        self._offsets = offsets
        self._layer_idx = layer_idx
        self._window = window

    @property
    def offset(self) -> mx.array:
        """RoPE offset of every row: the global position of its first (padded) query."""
        return self._offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._layout.stage_layer(self._layer_idx, keys, values)

    def make_mask(self, query_len: int, window_size: int | None = None, **_: object) -> mx.array:
        if query_len != self._layout.width:
            width = self._layout.width
            raise InvariantViolation("inv1", f"a mask for {query_len} queries was asked for a call over {width}")
        window = window_size if window_size is not None else self._window
        return mx.array(self._layout.mask(window=window)[:, None])  # [B, 1, T, K]

    @property
    def state(self) -> tuple[()]:
        return ()

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False


def batch_staging_layers(
    layout: BatchLayout[mx.array], layer_windows: tuple[int | None, ...]
) -> list[BatchStagingLayer]:
    """The per-layer cache objects of one padded batched model call."""
    offsets = mx.array(layout.position_matrix()[:, 0].astype("int32"))  # [B]
    return [BatchStagingLayer(layout, offsets, i, window) for i, window in enumerate(layer_windows)]
