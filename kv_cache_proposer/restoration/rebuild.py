"""Rebuilding evicted K/V from a session's restoration state: model forwards over tokens, kept K/V, f_θ.

What a rebuild produces is transient: the `RestoredPrefix` the session cache puts in front of its resident K/V.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol

import numpy as np

from kv_cache_proposer.cache.arrays import A, ArrayOps
from kv_cache_proposer.cache.layer_store import DenseLayerStore, LayerStore
from kv_cache_proposer.cache.protocol import KeyPart, SessionCache
from kv_cache_proposer.cache.session import KVSessionCache
from kv_cache_proposer.restoration.plan import LayerSource
from kv_cache_proposer.restoration.projection import kv_rows, rows_kv
from kv_cache_proposer.strategies import FullStrategy

_GROWTH = 256


class RestoredPrefix(Generic[A]):
    """Restored K/V of the contiguous evicted positions `[first, first + count)`, one growable buffer per layer
    (an `AttentionPrefix`)."""

    def __init__(self, ops: ArrayOps[A], num_layers: int, first: int) -> None:
        self._ops = ops
        self._first = first
        self._count = 0
        self._capacity = 0
        self._layers: list[DenseLayerStore[A]] = [DenseLayerStore(ops) for _ in range(num_layers)]
        self._positions = np.zeros(0, dtype=np.int64)

    @property
    def count(self) -> int:
        return self._count

    @property
    def positions(self) -> np.ndarray:
        return self._positions

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self._layers)

    def arrays(self) -> list[A]:
        return [array for layer in self._layers for array in layer.arrays()]

    def layer(self, layer_idx: int) -> tuple[A, A]:
        return self._layers[layer_idx].read(0, self._count)

    def extend(self, per_layer: Sequence[tuple[A, A]]) -> None:
        """Append the K/V `[B, H, m, D]` of the next m evicted positions, one pair per layer."""
        added = self._ops.length(per_layer[0][0])
        if added == 0:
            return
        needed = self._count + added
        if needed > self._capacity:
            self._capacity = max(needed, self._capacity + max(self._capacity // 2, _GROWTH))
            for layer in self._layers:
                layer.reserve(self._capacity)
        slots = np.arange(self._count, needed, dtype=np.int64)
        for layer, (keys, values) in zip(self._layers, per_layer, strict=True):
            layer.load(slots, keys, values)
        self._count = needed
        self._positions = np.arange(self._first, self._first + needed, dtype=np.int64)


class LayerForward(Protocol[A]):
    """The verifier's first layers over a block (`BackendModel.forward_layers`): what a rebuild runs."""

    def __call__(self, cache: SessionCache[A], token_ids: Sequence[int], last_layer: int) -> None:
        """Stage `token_ids` at the cache's next positions and run layers `0..last_layer` over them, each staging
        its K/V in `cache`; no later layer runs."""
        ...


class CaptureCache(KVSessionCache[A]):
    """A scratch cache for one forward over a block at global positions `start, start + 1, ...` that attends only
    within the block; it records the K/V the model stages for layers `0..last_layer`."""

    def __init__(self, ops: ArrayOps[A], num_layers: int, *, start: int, last_layer: int) -> None:
        super().__init__(FullStrategy(), num_layers=num_layers, ops=ops)
        self._next_position = start
        self._last_layer = last_layer
        self.captured: dict[int, tuple[A, A]] = {}

    @property
    def stage_offset(self) -> int:
        return 0  # nothing is resident: the block's slots start at 0 whatever its positions

    def stage_layer_parts(self, layer_idx: int, keys: A, values: A) -> tuple[KeyPart[A], ...]:
        self.captured[layer_idx] = (keys, values)
        if layer_idx == self._last_layer:
            return ((keys, values),)  # its attention's output is not needed either
        return super().stage_layer_parts(layer_idx, keys, values)


def forward_kv(
    forward: LayerForward[A], ops: ArrayOps[A], num_layers: int, tokens: Sequence[int], *, start: int, last_layer: int
) -> dict[int, tuple[A, A]]:
    """K/V `[B, H, len(tokens), D]` of layers `0..last_layer` for `tokens` at positions `start, start + 1, ...`,
    from one cache-less forward that attends only among `tokens`."""
    scratch: CaptureCache[A] = CaptureCache(ops, num_layers, start=start, last_layer=last_layer)
    forward(scratch, list(tokens), last_layer)
    captured = scratch.captured
    ops.settle([array for pair in captured.values() for array in pair])
    scratch.release()
    return captured


class PrefixCache(KVSessionCache[A]):
    """A scratch full-attention cache of layers `0..last_layer` for a forward over a token prefix in chunks: each
    chunk attends to the chunks before it, as the verifier's own chunked prefill does."""

    def __init__(self, ops: ArrayOps[A], *, last_layer: int) -> None:
        super().__init__(FullStrategy(), num_layers=last_layer + 1, ops=ops)

    def gather(self, layer_idx: int, positions: np.ndarray) -> tuple[A, A]:
        """K/V `[B, H, len(positions), D]` of committed positions (slot = position under `full`)."""
        return self._layers[layer_idx].gather(positions)


def prefix_kv(
    forward: LayerForward[A],
    ops: ArrayOps[A],
    tokens: Sequence[int],
    positions: np.ndarray,
    *,
    last_layer: int,
    chunk_tokens: int,
) -> dict[int, tuple[A, A]]:
    """K/V of layers `0..last_layer` at `positions` of the token prefix `tokens` (positions 0, 1, ...), from
    cache-less forwards over chunks of at most `chunk_tokens`: a forward's attention scores are `chunk x prefix`
    rather than `prefix x prefix`, so the transient memory grows linearly with the history."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    scratch: PrefixCache[A] = PrefixCache(ops, last_layer=last_layer)
    for start in range(0, len(tokens), chunk_tokens):
        block = list(tokens[start : start + chunk_tokens])
        forward(scratch, block, last_layer)
        scratch.commit(len(block))
    kv = {layer: scratch.gather(layer, positions) for layer in range(last_layer + 1)}
    ops.settle([array for pair in kv.values() for array in pair])
    scratch.release()
    return kv


def project(ops: ArrayOps[A], source: LayerSource, keys: A, values: A) -> tuple[A, A]:
    """A `projected` layer's K/V from the kept K/V `[B, H, P, D]` its f_θ reads."""
    if source.projection is None:
        return keys, values
    host_k, host_v = ops.to_host(keys), ops.to_host(values)  # [1, H, P, D]
    rows = source.projection.apply(kv_rows(host_k, host_v))  # [P, 2*H*D]
    out_k, out_v = rows_kv(rows, host_k.shape[1], host_k.shape[3])
    return ops.from_host(out_k, keys), ops.from_host(out_v, values)


def gather_all(store: LayerStore[A], count: int) -> tuple[A, A]:
    """The first `count` entries of a kept-K/V store."""
    return store.gather(np.arange(count, dtype=np.int64))
