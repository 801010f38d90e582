"""Handing a session cache to mlx-lm's attention through its cache protocol.

mlx-lm's models see one `StagingLayer` per layer: `offset` is the global position of the first token the model
call processes (the RoPE offset), `update_and_fetch` stages that call's K/V in the session cache and returns
everything its attention reads, and `make_mask` returns the strategy's mask over those keys.

A batched forward's rows (one batch row per session's block, `BatchLayout` padded) are attended row by row where the
model's attention calls mlx-lm's `scaled_dot_product_attention` by name (`route_rows`): the model modules' name
for it is pointed at `routed_attention`, which hands a `RowStagingLayer` its queries and passes every other call
to mlx-lm's function unchanged. Each row then reads its own keys, unpadded, under the mask its block gets alone.
"""

from __future__ import annotations

import sys
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_lm_base

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
        self._check_width(query_len)
        window = window_size if window_size is not None else self._window
        return mx.array(self._layout.mask(window=window)[:, None])  # [B, 1, T, K]

    def _check_width(self, query_len: int) -> None:
        if query_len != self._layout.width:
            width = self._layout.width
            raise InvariantViolation("inv1", f"a mask for {query_len} queries was asked for a call over {width}")

    @property
    def state(self) -> tuple[()]:
        return ()

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False


def batch_staging_layers(
    layout: BatchLayout[mx.array], layer_windows: tuple[int | None, ...], *, by_row: bool = False
) -> list[BatchStagingLayer]:
    """The per-layer cache objects of one padded batched model call; `by_row`: attended row by row
    (`RowStagingLayer`)."""
    offsets = mx.array(layout.position_matrix()[:, 0].astype("int32"))  # [B]
    if by_row:
        masks: dict[tuple[int, int | None], AttentionMask] = {}  # each row's, built once per forward
        return [RowStagingLayer(layout, offsets, i, window, masks) for i, window in enumerate(layer_windows)]
    return [BatchStagingLayer(layout, offsets, i, window) for i, window in enumerate(layer_windows)]


class RowStagingLayer(BatchStagingLayer):
    """One layer's view of a padded batched forward attended row by row: per-row RoPE offsets, each row's K/V staged
    in its own session cache, and attention (`attend`, reached through `routed_attention`) of each row's queries
    over what its cache returns, under the mask its block gets alone (`attention_mask`), the same call a forward of
    that block alone makes: no row's keys are padded or copied beside another's."""

    def __init__(
        self,
        layout: BatchLayout[mx.array],
        offsets: mx.array,
        layer_idx: int,
        window: int | None,
        masks: dict[tuple[int, int | None], AttentionMask],
    ) -> None:
        super().__init__(layout, offsets, layer_idx, window)
        self._masks = masks  # shared by the forward's layers: (row, window) -> that row's mask
        self._staged: list[tuple[mx.array, mx.array]] = []
        self.attended = 0  # calls of `attend`: one per forward when the model's attention was routed

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Stage each row's K/V in its own cache; returns the call's own K/V, which `attend` does not read."""
        layout = self._layout
        self._staged = []
        for index, block in enumerate(layout.blocks):
            row, start, end = layout.query_span(index)
            rows = slice(row, row + 1)
            self._staged.append(
                block.cache.stage_layer(self._layer_idx, keys[rows, :, start:end], values[rows, :, start:end])
            )
        return keys, values

    def make_mask(self, query_len: int, window_size: int | None = None, **_: object) -> None:  # type: ignore[override]
        self._check_width(query_len)
        return None  # each row's own, in `attend`

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None) -> mx.array:
        """Attention of the call's queries `[B, H, T, D]`: each row's over its own staged keys, padded queries
        zeros."""
        layout = self._layout
        outputs = []
        for index, block in enumerate(layout.blocks):
            row, start, end = layout.query_span(index)
            keys, values = self._staged[index]
            key = (index, self._window)
            if key not in self._masks:
                self._masks[key] = attention_mask(block.cache, end - start, self._window, return_array=False)
            mask = self._masks[key]
            out = mx.fast.scaled_dot_product_attention(
                queries[row : row + 1, :, start:end], keys, values, scale=scale, mask=mask, sinks=sinks
            )
            if start:
                out = mx.concatenate([mx.zeros((1, out.shape[1], start, out.shape[3]), dtype=out.dtype), out], axis=2)
            outputs.append(out)
        self.attended += 1
        return mx.concatenate(outputs, axis=0)


_LIBRARY_ATTENTION = mlx_lm_base.scaled_dot_product_attention


def routed_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`, except that a `RowStagingLayer`'s call attends row by row."""
    if isinstance(cache, RowStagingLayer):
        return cache.attend(queries, scale, sinks)
    return _LIBRARY_ATTENTION(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def route_rows(model: nn.Module) -> bool:
    """Point the name `scaled_dot_product_attention` in the modules that define `model`'s layers at
    `routed_attention` (the same function for every other caller); returns whether some module of the model's
    called mlx-lm's by that name (else its batched rows stay padded)."""
    routed = False
    for name in {type(module).__module__ for _, module in model.named_modules()}:
        defined = sys.modules.get(name)
        found = getattr(defined, "scaled_dot_product_attention", None)
        if defined is not None and found is _LIBRARY_ATTENTION:
            setattr(defined, "scaled_dot_product_attention", routed_attention)  # noqa: B010 (a module's global)
            routed = True
        elif found is routed_attention:
            routed = True
    return routed
