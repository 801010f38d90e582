"""The session cache: one session's K/V under a KV strategy, written once for every backend.

A slot table (the global position of every slot) plus one `LayerStore` per layer (`ResidentCache`): resident
slots, then the stage of the forward in flight; a commit makes a prefix of the stage resident and evicts per
strategy, and rejected drafts never overwrite a resident entry. The layout of each strategy, the reads of lossy
stores and attention prefixes are described in docs/architecture.md ("Session caches").
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache, partial
from typing import Any, cast

import numpy as np

from kv_cache_proposer.cache.arrays import A, ArrayOps
from kv_cache_proposer.cache.key_layout import BlockedLayout
from kv_cache_proposer.cache.layer_store import (
    DenseLayerStore,
    LayerStoreFactory,
    ReadOnceStage,
    RestingStore,
    finish_stages,
    joined_parts,
    start_stages,
)
from kv_cache_proposer.cache.protocol import NO_CALL, AttentionPrefix, CacheFootprint, KeyPart, ModelCall
from kv_cache_proposer.cache.resident import ResidentCache
from kv_cache_proposer.errors import InvariantViolation
from kv_cache_proposer.strategies import KVStrategy, make_strategy

_GROWTH_TOKENS = 256


@cache
def _reads_once(store: type) -> bool:
    """Whether a layer store of this type is a `ReadOnceStage` (checked once per type: a protocol's instance check
    looks up its members at every call, and a forward asks once per layer)."""
    return issubclass(store, ReadOnceStage)


class KVSessionCache(ResidentCache[A]):
    """The session cache of every backend: stage, model call, commit and eviction over the resident slots."""

    stage_read_once = True
    """Whether nothing reads a layer's stage once the forward's attention in that layer has (`ReadOnceStage`)."""

    def __init__(
        self,
        strategy: KVStrategy,
        *,
        num_layers: int,
        ops: ArrayOps[A],
        layer_store: LayerStoreFactory[A] | None = None,
        key_block: int | None = None,
    ) -> None:
        """`key_block`: the backend's attention reads keys in whole blocks of that many and gives a query the same
        values for the same keys at the same places in its blocks; a bounded cache of dense layers then hands
        attention its keys in position order at places set by position alone (`BlockedLayout`), not in the
        ring's order, at the cost of a copy per layer and forward."""
        super().__init__(strategy, num_layers=num_layers, ops=ops, layer_store=layer_store)
        self._lossy = any(layer.lossy for layer in self._layers)
        self._key_block = key_block  # as given, for a copy under another strategy
        # what the model calls lay their keys out by: bounded caches of dense layers
        self._layout_block = key_block if strategy.bounded_slots is not None and not self._lossy else None
        if key_block and strategy.bounded_slots is None:  # attention reads a layer's K/V up to a whole key block
            for layer in self._layers:
                if isinstance(layer, DenseLayerStore):
                    layer.read_past = key_block - 1
        self._layout: BlockedLayout | None = None  # where the model call in flight reads its keys, if blocked
        self._query_start = self._query_end = 0  # the part of the stage the model call in flight processes
        self._staged_counts = [0] * num_layers  # staged K/V written per layer since the stage began
        self._prefix: AttentionPrefix[A] | None = None
        self._call = NO_CALL
        self._released = False
        self._horizon: int | None = None  # the slots this generation may fill at most (`expect`); None: unknown
        self._forward_bytes = 0  # `nbytes` as the last forward ended, its stage whole (`CacheFootprint`)

    # -- what is held --------------------------------------------------------------------------------------------
    def footprint(self) -> CacheFootprint:
        used = self._parked_slots()
        compressed = dense = escaped = working = 0
        for layer in self._layers:
            held = layer.footprint()
            compressed += held.compressed_bytes
            dense += held.dense_equivalent_bytes
            escaped += held.escaped_vectors
            working += layer.working_nbytes(used)
        evicted = self.evicted_count
        return CacheFootprint(
            resident_count=self.resident_count,
            evicted_count=evicted,
            lost_count=evicted,
            nbytes=self.nbytes,
            working_bytes=working,
            compressed_bytes=compressed,
            dense_equivalent_bytes=dense,
            escaped_vectors=escaped,
            forward_bytes=self._forward_bytes,
        )

    @property
    def restoration_feature_layers(self) -> tuple[int, ...]:
        """Layers whose outputs the cache needs from every forward (none unless it restores from them)."""
        return ()

    def take_features(self, features: np.ndarray) -> None:
        return None

    def park(self) -> None:
        """Between generations: every layer drops what only speeds up forwards and, unless the strategy bounds
        the slots, the cache its spare capacity (the next forward grows it again)."""
        self._settle(rest=False)

    def rest(self) -> bool:
        return self._settle(rest=True)

    def _settle(self, *, rest: bool) -> bool:
        """`park`, or `rest`: whether a layer rested."""
        used = self._parked_slots()
        rested = False
        for layer in self._layers:
            if rest and isinstance(layer, RestingStore):
                rested = layer.rest(used) or rested
            else:
                layer.park(used)
        self._slots.shrink(used)
        self._horizon = None
        self._forward_bytes = 0
        return rested

    def expect(self, positions: int) -> None:
        self._horizon = self.stage_offset + positions

    def _parked_slots(self) -> int:
        """The slots a parked cache keeps room for: its resident slots, or all of them when the strategy bounds
        the slots (a bounded cache's room is its window and one block)."""
        return self._slots.capacity if self._strategy.bounded_slots is not None else max(self.stage_offset, 1)

    # -- the model call in flight ------------------------------------------------------------------------------
    @property
    def call(self) -> ModelCall:
        return self._call

    def _locate_call(self) -> None:
        """The geometry of the model call just selected (`call`)."""
        offset = self.stage_offset
        queries = self._slots.positions[offset + self._query_start : offset + self._query_end]
        count = self._query_end - self._query_start
        own = count if self._lossy and count > 1 else 0  # a lossy cache's call over several queries reads them
        parts = [self._slots.positions[: offset + self._query_end]]
        prefix = 0
        if self._prefix is not None:
            parts.insert(0, self._prefix.positions)
            prefix = int(self._prefix.positions.size)
        if own:
            parts.append(queries)
        self._layout = None if self._layout_block is None else BlockedLayout(parts, self._layout_block)
        if self._layout is not None:
            keys, before = self._layout.positions, self._layout.positions.size - count
        else:
            keys = parts[0] if len(parts) == 1 else np.concatenate(parts)
            before = prefix + offset + self._query_start
        self._call = ModelCall(
            query_positions=queries,
            key_positions=keys,
            query_offset=self._next_position + self._query_start,
            keys_before_queries=before,
            own_keys=own,
            prefix_keys=prefix,
        )

    @property
    def prefix(self) -> AttentionPrefix[A] | None:
        """The K/V read ahead of the cache's own slots, if any."""
        return self._prefix

    def attach_prefix(self, prefix: AttentionPrefix[A] | None) -> None:
        """Read `prefix` ahead of the cache's own slots in every forward from now on (None: stop)."""
        self._prefix = prefix
        if self._call is not NO_CALL:
            self._locate_call()

    def begin_stage(self, block_len: int, *, extend: bool = False, token_ids: Sequence[int] = ()) -> None:
        if self._released:
            raise RuntimeError("the cache was released")
        if block_len < 1:
            raise ValueError(f"a block holds at least one position, got {block_len}")
        if extend:
            self._finish_stage()
        kept = self._staged if extend else 0
        offset = self.stage_offset
        needed, capacity = offset + kept + block_len, self._slots.capacity
        if needed > capacity:
            if self._strategy.bounded_slots is None:
                # Unbounded caches grow geometrically so appends stay amortised O(1), but never past what the
                # generation can fill: room beyond it would only count against the session's peak.
                grown = capacity + max(capacity // 2, _GROWTH_TOKENS)
                needed = max(needed, grown if self._horizon is None else min(grown, self._horizon))
            self._grow(needed)
        self._slots.stage(offset + kept, self._next_position + kept, block_len)
        self._staged = kept + block_len
        if not extend:
            self._staged_counts = [0] * len(self._layers)
        self.select_queries(kept, kept + block_len)

    def name_stage(self, token_ids: Sequence[int]) -> None:
        pass  # keeps no token ids

    def select_queries(self, start: int, end: int) -> None:
        if not 0 <= start < end <= self._staged:
            raise ValueError(f"cannot select [{start}, {end}) of a stage of {self._staged}")
        self._query_start, self._query_end = start, end
        self._locate_call()

    def stage_layer(self, layer_idx: int, keys: A, values: A) -> tuple[A, A]:
        return joined_parts(self._ops, self.stage_layer_parts(layer_idx, keys, values))

    def stage_layer_parts(self, layer_idx: int, keys: A, values: A) -> tuple[KeyPart[A], ...]:
        count = self._query_end - self._query_start
        given = self._ops.length(keys)
        if given != count:
            raise InvariantViolation(
                "inv1", f"layer {layer_idx} staged {given} K/V for a model call over {count} positions"
            )
        if self.stage_read_once and layer_idx and self._query_start == 0 and self._query_end == self._staged:
            # The layer before has attended (its output is this layer's input), and no other call reads the stage.
            before = self._layers[layer_idx - 1]
            if _reads_once(type(before)):
                cast(ReadOnceStage, before).stage_read()
        layer = self._layers[layer_idx]
        offset = self.stage_offset
        layer.stage(offset + self._query_start, keys, values)
        self._staged_counts[layer_idx] += count
        if self._lossy and layer_idx == len(self._layers) - 1:
            start_stages(self._layers)  # the forward's deferred work may run beside its last layer and head
        parts = layer.read_parts(offset, offset + self._query_end)
        if self._layout is not None:  # the prefix's keys and the slots', as the layout's parts
            prefix = [] if self._prefix is None else [joined_parts(self._ops, [self._prefix.layer(layer_idx)])]
            return (self._layout.gather(self._ops, [*prefix, joined_parts(self._ops, parts)]),)
        if self._prefix is None:
            return tuple(parts)
        return (self._prefix.layer(layer_idx), *parts)

    # -- commit ------------------------------------------------------------------------------------------------
    def commit(self, count: int) -> None:
        staged = self._staged
        if not 0 <= count <= staged:
            raise ValueError(f"cannot commit {count} of {staged} staged positions")
        if count and any(written != staged for written in self._staged_counts):
            missing = [i for i, written in enumerate(self._staged_counts) if written != staged]
            raise InvariantViolation("inv1", f"layers {missing} did not receive the K/V of the whole block")
        if staged:
            # The forward's high: everything held, with the whole stage (what a compressed layer then codes and
            # drops, or the K/V of the positions this commit rejects) not yet committed.
            self._forward_bytes = self.nbytes
        if count:
            self._finish_stage()
        plan = self._slots.commit_plan(self._strategy, self.stage_offset, self._next_position, count)
        for layer in self._layers:
            if layer.active:
                layer.commit(plan)
        if plan.slots is not None and plan.sources is not None:
            self._slots.positions[plan.slots] = plan.sources + self._next_position
        self._next_position += count
        self._staged = self._query_start = self._query_end = 0
        self._call = NO_CALL
        self._staged_counts = [0] * len(self._layers)
        self._ops.settle(self.arrays())
        self.check_invariants()

    def _finish_stage(self) -> None:
        """The layers finish their forwards' deferred work together (a lossy store codes one-token forwards' K/V:
        one pass of the codec for every layer)."""
        if self._lossy and self._staged:
            finish_stages(self._layers)

    # -- copies --------------------------------------------------------------------------------------------------
    @classmethod
    def from_state(
        cls,
        state: Sequence[tuple[A, A] | None],
        meta_state: dict[str, Any],
        *,
        ops: ArrayOps[A],
        layer_store: LayerStoreFactory[A] | None = None,
    ) -> KVSessionCache[A]:
        """A cache holding what `state` / `meta_state` of another cache describe."""
        options = {key: int(meta_state[key]) for key in ("sink", "window") if key in meta_state}
        strategy = make_strategy(str(meta_state["strategy"]), **options)
        cache = cls(strategy, num_layers=len(state), ops=ops, layer_store=layer_store)
        cache._restore(state, np.asarray(meta_state["positions"], dtype=np.int64), int(meta_state["next_position"]))
        return cache

    def clone(self, length: int) -> KVSessionCache[A]:
        return self.clone_under(length, self._strategy)

    def clone_under(self, length: int, strategy: KVStrategy) -> KVSessionCache[A]:
        """A copy holding the first `length` committed positions under `strategy`, which must keep only positions
        this cache still holds."""
        if not 0 <= length <= self._next_position:
            raise ValueError(f"cannot clone {length} positions of a cache holding {self._next_position}")
        slots = self._resident_slots()
        positions = self._slots.positions[slots]
        wanted = strategy.resident_positions(length)
        present = np.isin(wanted, positions)
        if not present.all():
            raise ValueError(
                f"positions {wanted[~present][:5].tolist()} that {length} committed positions keep resident "
                "were already evicted"
            )
        keep = slots[np.isin(positions, wanted)]
        twin = KVSessionCache(
            strategy,
            num_layers=len(self._layers),
            ops=self._ops,
            layer_store=self._layer_store,
            key_block=self._key_block,
        )
        # Each layer copies the entries in the form it holds them (a compressed layer copies its codes).
        loads = [
            partial(twin_layer.load_from, layer, keep) if layer.active else None
            for twin_layer, layer in zip(twin._layers, self._layers, strict=True)
        ]
        twin._fill(loads, self._slots.positions[keep], length)
        return twin

    def release(self) -> None:
        for layer in self._layers:
            layer.release()
        self._slots.release()
        self._prefix = None
        self._released = True
