"""Rebuilding evicted K/V from a session's restoration state: model forwards over tokens, kept K/V, f_θ.

What a rebuild produces is transient: the `RestoredPrefix` the session cache puts in front of its resident K/V.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol

import numpy as np

from kv_cache_proposer.cache.arrays import A, ArrayOps
from kv_cache_proposer.cache.layer_store import LayerStore, LayerStoreFactory
from kv_cache_proposer.cache.protocol import KeyPart, SessionCache
from kv_cache_proposer.cache.session import KVSessionCache
from kv_cache_proposer.compression.codec import LatticeCodec, StagedCoding
from kv_cache_proposer.compression.held_residents import HeldResidents
from kv_cache_proposer.compression.packed_store import PackedLayerStore
from kv_cache_proposer.restoration.plan import LayerSource
from kv_cache_proposer.restoration.projection import kv_rows, rows_kv
from kv_cache_proposer.strategies import FullStrategy

_GROWTH = 256


Entries = tuple[A, A] | StagedCoding[A]
"""Restored K/V of some positions: dense keys and values `[B, H, m, D]`, or their lattice coding."""


class PrefixLayer(Protocol[A]):
    """One layer's restored K/V, addressed by restored index: a `DenseLayerStore`, or a `HeldPrefixLayer`."""

    @property
    def nbytes(self) -> int: ...

    def arrays(self) -> list[A]: ...

    def reserve(self, capacity: int) -> None: ...

    def load(self, slots: np.ndarray, keys: A, values: A) -> None:
        """Hold `keys`/`values` `[B, H, len(slots), D]` at `slots`."""
        ...

    def read_parts(self, stage_offset: int, end: int) -> list[KeyPart[A]]:
        """Indices `[0, end)` as attention reads them (one part)."""
        ...


class HeldPrefixLayer(Generic[A]):
    """Restored K/V coded by the session's own lattice codec and held as coordinates (`HeldResidents`, about a
    quarter of the dense bytes), which attention reads chunk by chunk without a dense copy."""

    def __init__(self, ops: ArrayOps[A], codec: LatticeCodec[A], dtype: Any) -> None:
        self._ops = ops
        self._codec = codec
        self._dtype = dtype
        self._held: HeldResidents[A] | None = None
        self._capacity = 0

    @property
    def nbytes(self) -> int:
        return 0 if self._held is None else self._held.nbytes

    def arrays(self) -> list[A]:
        return [] if self._held is None else self._held.arrays()

    def reserve(self, capacity: int) -> None:
        self._capacity = max(self._capacity, capacity)
        if self._held is not None:
            self._held.reserve(capacity)

    def load(self, slots: np.ndarray, keys: A, values: A) -> None:
        """Code `keys`/`values` on the host, without the decoded copy `code_blocks` would also make (one vector of
        theirs shows the codings' arrays)."""
        if self._held is None:
            one = np.zeros(1, dtype=np.int64)
            first = (self._ops.take(keys, one), self._ops.take(values, one))
            self._holder(self._codec.code_blocks([first], self._dtype)[0][2])
        batch = int(keys.shape[0])  # type: ignore[attr-defined]
        self._holder().put_host(slots, self._codec.encode(keys), self._codec.encode(values), batch)

    def put(self, slots: np.ndarray, coding: StagedCoding[A]) -> None:
        """Hold `coding` as it is."""
        self._holder(coding).put(slots, coding)

    def _holder(self, sample: StagedCoding[A] | None = None) -> HeldResidents[A]:
        if self._held is None:
            if sample is None:
                raise ValueError("the layer holds no restored K/V")
            self._held = HeldResidents(self._ops, self._codec, sample, self._dtype)
            self._held.reserve(self._capacity)
        return self._held

    def read_parts(self, stage_offset: int, end: int) -> list[KeyPart[A]]:
        return [self._holder().keys(end)]


PrefixLayerFactory = Callable[[int], "PrefixLayer[A]"]
"""Builds the restored K/V of one layer (by index)."""


class RestoredPrefix(Generic[A]):
    """Restored K/V of the contiguous evicted positions `[first, first + count)`, one growable buffer per layer
    (an `AttentionPrefix`): dense, or held as lattice coordinates (`HeldPrefixLayer`)."""

    def __init__(
        self, ops: ArrayOps[A], num_layers: int, first: int, layer: PrefixLayerFactory[A], *, coded: bool
    ) -> None:
        """`layer` builds each layer's buffer; `coded`: they hold coordinates (`HeldPrefixLayer`), not K/V."""
        self._ops = ops
        self._first = first
        self._count = 0
        self._capacity = 0
        self._horizon: int | None = None  # the positions it may hold before its session parks (`bound`)
        self.coded = coded
        self._layers: list[PrefixLayer[A]] = [layer(index) for index in range(num_layers)]
        self._positions = np.zeros(0, dtype=np.int64)

    @property
    def count(self) -> int:
        return self._count

    @property
    def positions(self) -> np.ndarray:
        return self._positions

    @property
    def capacity(self) -> int:
        """Positions the buffers have room for."""
        return self._capacity

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self._layers)

    def arrays(self) -> list[A]:
        return [array for layer in self._layers for array in layer.arrays()]

    def layer(self, layer_idx: int) -> KeyPart[A]:
        return self._layers[layer_idx].read_parts(0, self._count)[0]

    def reserve(self, count: int) -> None:
        """Room for `count` restored positions in all."""
        if count > self._capacity:
            self._capacity = count
            for layer in self._layers:
                layer.reserve(count)

    def bound(self, horizon: int | None) -> None:
        """Until its session parks it holds at most `horizon` positions (None: unknown): growing, it reserves no
        room beyond them."""
        self._horizon = horizon

    def extend(self, per_layer: Sequence[Entries[A]]) -> None:
        """Append the K/V `[B, H, m, D]` (or their coding) of the next m evicted positions, one per layer."""
        added = self._length(per_layer[0])
        if added == 0:
            return
        needed = self._count + added
        if needed > self._capacity:
            # Geometric growth keeps appends amortised O(1), but room past what the generation can evict would
            # only raise the session's peak (half the restored history, at the first eviction after a rebuild).
            grown = self._capacity + max(self._capacity // 2, _GROWTH)
            self.reserve(max(needed, grown if self._horizon is None else min(grown, self._horizon)))
        slots = np.arange(self._count, needed, dtype=np.int64)
        for layer, entries in zip(self._layers, per_layer, strict=True):
            _load(layer, slots, entries)
        self.cover(needed)

    def put(self, layer_idx: int, first: int, entries: Entries[A]) -> None:
        """Hold one layer's `entries` from restored index `first` on, within the reserved room (a rebuild fills
        the layers one by one, then `cover`s them)."""
        count = self._length(entries)
        if first + count > self._capacity:
            raise ValueError(f"restored indices up to {first + count} exceed the reserved {self._capacity}")
        _load(self._layers[layer_idx], np.arange(first, first + count, dtype=np.int64), entries)

    def _length(self, entries: Entries[A]) -> int:
        return self._ops.length(entries.doubled if isinstance(entries, StagedCoding) else entries[0])

    def cover(self, count: int) -> None:
        """The first `count` restored indices of every layer hold their positions' K/V."""
        self._count = count
        self._positions = np.arange(self._first, self._first + count, dtype=np.int64)


def _load(layer: PrefixLayer[A], slots: np.ndarray, entries: Entries[A]) -> None:
    """Hold `entries` at `slots` of one restored layer: codings only where it holds coordinates."""
    if not isinstance(entries, StagedCoding):
        layer.load(slots, *entries)
    elif isinstance(layer, HeldPrefixLayer):
        layer.put(slots, entries)
    else:
        raise TypeError("dense restored K/V take K/V, not codings")


def new_prefix(
    ops: ArrayOps[A], resident: Sequence[LayerStore[A]], first: int, dense: LayerStoreFactory[A]
) -> RestoredPrefix[A]:
    """An empty restored prefix from position `first`: held as coordinates of a session's own lattice codec where
    its `resident` layers are held so while it generates (a compressed session whose verifier's attention reads
    them), else in `dense` layers."""
    codecs = [store.codec() for store in resident if isinstance(store, PackedLayerStore) and store.reads_held]
    if len(codecs) != len(resident):
        return RestoredPrefix(ops, len(resident), first, lambda _: dense(ops), coded=False)
    return RestoredPrefix(ops, len(resident), first, lambda i: HeldPrefixLayer(ops, *codecs[i]), coded=True)


class LayerForward(Protocol[A]):
    """The verifier's first layers over a block (`BackendModel.forward_layers`): what a rebuild runs."""

    def __call__(self, cache: SessionCache[A], token_ids: Sequence[int], last_layer: int) -> None:
        """Stage `token_ids` at the cache's next positions and run layers `0..last_layer` over them, each staging
        its K/V in `cache`; no later layer runs."""
        ...


class LayerCommit(Protocol[A]):
    """The verifier's commit of a staged block (`BackendModel.commit`): a rebuild's chunked prefix forward commits
    each chunk as the verifier's own forwards are committed (in its inference context, say)."""

    def __call__(self, cache: SessionCache[A], count: int) -> None:
        """Commit the first `count` staged positions of `cache`."""
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
    chunk attends to the chunks before it, as the verifier's own chunked prefill does. `layer_store`: what holds
    its K/V (a compressed session's own store, say; None: dense)."""

    def __init__(self, ops: ArrayOps[A], *, last_layer: int, layer_store: LayerStoreFactory[A] | None = None) -> None:
        super().__init__(FullStrategy(), num_layers=last_layer + 1, ops=ops, layer_store=layer_store)

    def gather(self, layer_idx: int, positions: np.ndarray) -> tuple[A, A]:
        """K/V `[B, H, len(positions), D]` of committed positions (slot = position under `full`)."""
        return self._layers[layer_idx].gather(positions)

    def entries(self, layer_idx: int, positions: np.ndarray) -> Entries[A]:
        """What one layer holds for committed positions: their coding where the layer holds coordinates
        (`PackedLayerStore.held_coding`), else their K/V."""
        store = self._layers[layer_idx]
        coding = store.held_coding(positions) if isinstance(store, PackedLayerStore) else None
        return coding if coding is not None else store.gather(positions)

    def release_layer(self, layer_idx: int) -> None:
        """Drop one layer's K/V (a rebuild is done with it)."""
        self._layers[layer_idx].release()


def prefix_cache(
    forward: LayerForward[A],
    commit: LayerCommit[A],
    ops: ArrayOps[A],
    tokens: Sequence[int],
    *,
    last_layer: int,
    chunk_tokens: int,
    layer_store: LayerStoreFactory[A] | None = None,
) -> PrefixCache[A]:
    """The K/V of layers `0..last_layer` over the token prefix `tokens` (positions 0, 1, ...), from cache-less
    forwards over chunks of at most `chunk_tokens`: a forward's attention scores are `chunk x prefix` rather than
    `prefix x prefix`, so the transient memory grows linearly with the history. The caller gathers what it needs
    and releases the cache."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    scratch: PrefixCache[A] = PrefixCache(ops, last_layer=last_layer, layer_store=layer_store)
    try:
        for start in range(0, len(tokens), chunk_tokens):
            block = list(tokens[start : start + chunk_tokens])
            forward(scratch, block, last_layer)
            commit(scratch, len(block))
    except BaseException:
        scratch.release()
        raise
    return scratch


def prefix_kv(
    forward: LayerForward[A],
    commit: LayerCommit[A],
    ops: ArrayOps[A],
    tokens: Sequence[int],
    positions: np.ndarray,
    *,
    last_layer: int,
    chunk_tokens: int,
) -> dict[int, tuple[A, A]]:
    """Dense K/V of layers `0..last_layer` at `positions` of the token prefix `tokens` (`prefix_cache`)."""
    scratch = prefix_cache(forward, commit, ops, tokens, last_layer=last_layer, chunk_tokens=chunk_tokens)
    kv = {layer: scratch.gather(layer, positions) for layer in range(last_layer + 1)}
    ops.settle([array for pair in kv.values() for array in pair])
    scratch.release()
    return kv


def project(ops: ArrayOps[A], source: LayerSource, keys: A, values: A, positions: np.ndarray) -> tuple[A, A]:
    """A `projected` layer's K/V from the kept K/V `[B, H, P, D]` its f_θ reads, of the evicted `positions` `[P]`."""
    if source.projection is None:
        return keys, values
    host_k, host_v = ops.to_host(keys), ops.to_host(values)  # [1, H, P, D]
    rows = source.projection.apply(kv_rows(host_k, host_v), positions)  # [P, 2*H*D]
    out_k, out_v = rows_kv(rows, host_k.shape[1], host_k.shape[3])
    return ops.from_host(out_k, keys), ops.from_host(out_v, values)
