"""The `dlm_restore` session cache: sink + window resident, every evicted position restored for each forward.

Between generations the cache holds its resident K/V plus the plan's per-position state of the evicted positions
(the K/V of `kept` layers, through the session's layer store and so its compressor, and the token ids when a layer
is rebuilt by a forward). Before a forward it makes sure a `RestoredPrefix` covers every evicted position and reads
it ahead of the resident slots at the positions' true global positions:

- rebuild `generation`: the prefix is rebuilt from the state when a generation starts and then extended at each
  commit with the positions that leave the window; `park()` drops it.
- rebuild `step`: the prefix is rebuilt from the state before every forward and dropped after its commit.

Positions leaving the window are captured at commit, before their slots are overwritten. A session whose resident
layers are held as lattice coordinates while it generates holds its restored K/V so too (`new_prefix`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from kv_cache_proposer.cache.arrays import A, ArrayOps
from kv_cache_proposer.cache.layer_store import DenseLayerStore, LayerStore, LayerStoreFactory
from kv_cache_proposer.cache.protocol import CacheFootprint, KeyPart
from kv_cache_proposer.cache.session import KVSessionCache
from kv_cache_proposer.compression.packed_store import PackedLayerStore
from kv_cache_proposer.errors import InvariantViolation
from kv_cache_proposer.restoration.drafter_context import ContextStore
from kv_cache_proposer.restoration.plan import LayerSource, RestorationPlan
from kv_cache_proposer.restoration.projection import rows_kv
from kv_cache_proposer.restoration.rebuild import (
    Entries,
    LayerCommit,
    LayerForward,
    PrefixCache,
    RestoredPrefix,
    forward_kv,
    new_prefix,
    prefix_cache,
    project,
)
from kv_cache_proposer.restoration.setup import REBUILD_RUN, RestorationSetup
from kv_cache_proposer.strategies import DlmRestoreStrategy


class RestoringSessionCache(KVSessionCache[A]):
    """`KVSessionCache` under `dlm_restore`: resident sink + window, restored K/V of every evicted position."""

    def __init__(
        self,
        strategy: DlmRestoreStrategy,
        *,
        num_layers: int,
        ops: ArrayOps[A],
        forward_layers: LayerForward[A],
        commit: LayerCommit[A],
        chunk_tokens: int,
        setup: RestorationSetup,
        layer_store: LayerStoreFactory[A] | None = None,
    ) -> None:
        super().__init__(strategy, num_layers=num_layers, ops=ops, layer_store=layer_store)
        self._restoring = strategy
        self._forward_layers = forward_layers  # the verifier's first layers: `tokens` and `recompute` rebuilds
        self._commit = commit  # the verifier's commit of a rebuild's prefix chunk
        self._chunk_tokens = chunk_tokens  # the most tokens a rebuild forward takes
        self._setup = setup
        self._session_store = layer_store  # the session's own store (None: dense), which a clone gets too
        self._plan = setup.plan_for(num_layers)
        # Kept layers go through the session's compressor when it has one, else through the plan's.
        kept_store: LayerStoreFactory[A] = layer_store or setup.kept_store or DenseLayerStore
        self._kept: dict[int, LayerStore[A]] = {layer: kept_store(ops) for layer in self._plan.kept_layers}
        self._kept_capacity = 0
        self._tokens = np.zeros(0, dtype=np.int32)  # committed token ids, when a layer is rebuilt from them
        self._stage_tokens: list[int] = []
        self._restored: RestoredPrefix[A] | None = None
        self._peak_restored_bytes = 0
        drafter = self._plan.drafter if self._plan.uses_drafter else None
        # The drafter context rows of committed positions past the sink, for `projected<-drafter` layers.
        self._contexts = None if drafter is None else ContextStore(drafter, strategy.sink)
        self._kv_like: A | None = None  # one position's K `[1, H, 1, D]`, for K/V built on the host

    # -- byte accounting ---------------------------------------------------------------------------------------
    @property
    def plan(self) -> RestorationPlan:
        return self._plan

    @property
    def resident_bytes(self) -> int:
        """Bytes of the resident K/V and the slot table."""
        return super().nbytes

    def _restored_bytes(self) -> int:
        """Bytes of the restored K/V of evicted positions held now (transient)."""
        return 0 if self._restored is None else self._restored.nbytes

    def _state_bytes(self) -> int:
        """Bytes of the kept layers' K/V of evicted positions (exactly what they need while parked), plus the
        drafter context rows of every committed position past the sink when a layer is projected from them."""
        contexts = 0 if self._contexts is None else self._contexts.nbytes
        return sum(store.nbytes for store in self._kept.values()) + contexts

    @property
    def nbytes(self) -> int:
        return self.resident_bytes + self._state_bytes() + int(self._tokens.nbytes) + self._restored_bytes()

    def footprint(self) -> CacheFootprint:
        """The resident part's footprint, with the plan's state, the token ids kept for `tokens` and `recompute`
        rebuilds (the session's history, which every session holds anyway, so reported apart from the plan's K/V
        state) and the restored K/V; no position is lost."""
        return dataclasses.replace(
            super().footprint(),
            lost_count=0,
            restored_count=0 if self._restored is None else self._restored.count,
            nbytes=self.nbytes,
            restored_bytes=self._restored_bytes(),
            peak_restored_bytes=self._peak_restored_bytes,
            restoration_state_bytes=self._state_bytes(),
            history_token_bytes=int(self._tokens.nbytes),
        )

    @property
    def restoration_feature_layers(self) -> tuple[int, ...]:
        """Verifier layers whose outputs a forward must hand to `take_features` (the drafter context's inputs)."""
        return self._plan.feature_layers

    def take_features(self, features: np.ndarray) -> None:
        """The outputs `[n, L*H]` (host) of `restoration_feature_layers` for the positions of the model call in
        flight."""
        if self._contexts is not None:
            self._contexts.stage_features(self._query_start, features)

    def arrays(self) -> list[A]:
        held = super().arrays() + [array for store in self._kept.values() for array in store.arrays()]
        return held if self._restored is None else held + self._restored.arrays()

    def park(self) -> None:
        """Drop the restored K/V and the spare capacity of the kept layers: a parked session holds its resident
        K/V and exactly the plan's state of its evicted positions."""
        self._drop_restored()
        held = self.evicted_count
        for store in self._kept.values():
            store.park(held)  # each store drops its room beyond the evicted positions (one copy per generation)
        self._kept_capacity = min(self._kept_capacity, held)
        if self._contexts is not None:
            self._contexts.trim()
        super().park()

    def release(self) -> None:
        self._drop_restored()
        for store in self._kept.values():
            store.release()
        self._tokens = np.zeros(0, dtype=np.int32)
        super().release()

    # -- forwards ----------------------------------------------------------------------------------------------
    def begin_stage(self, block_len: int, *, extend: bool = False, token_ids: Sequence[int] = ()) -> None:
        named = len(token_ids) == block_len or (extend and not token_ids)  # a burst names its picks at its end
        if self._plan.needs_tokens and not named:
            raise ValueError(f"dlm_restore rebuilds K/V from token ids: {len(token_ids)} for a block of {block_len}")
        self._stage_tokens = [*self._stage_tokens, *token_ids] if extend else list(token_ids)
        evicted = self.evicted_count
        if evicted and (self._restored is None or self._restored.count != evicted):
            self._restored = self._rebuild(evicted)
            self._note_peak()
        self.attach_prefix(self._restored)
        super().begin_stage(block_len, extend=extend)
        if self._contexts is not None:
            self._contexts.begin_stage(block_len, extend=extend)

    def name_stage(self, token_ids: Sequence[int]) -> None:
        if len(token_ids) != self._staged:
            raise ValueError(f"{len(token_ids)} token ids named for {self._staged} staged positions")
        self._stage_tokens = list(token_ids)

    def commit(self, count: int) -> None:
        if not 0 <= count <= self._staged:
            raise ValueError(f"cannot commit {count} of {self._staged} staged positions")
        if count and self._plan.needs_tokens and len(self._stage_tokens) < count:
            raise ValueError(f"dlm_restore rebuilds K/V from token ids: {len(self._stage_tokens)} named for {count}")
        before = self.next_position
        if count:
            self._finish_stage()  # the entries captured below are read as the layers hold them
        leaving = self._leaving(before, count)  # [m] positions this commit evicts, ascending
        captured = self._capture(leaving, before) if leaving.size else {}
        if count and self._plan.needs_tokens:
            self._tokens = np.concatenate([self._tokens, np.asarray(self._stage_tokens[:count], dtype=np.int32)])
        self._stage_tokens = []
        if self._contexts is not None:
            try:
                self._contexts.commit(before, count)
            except ValueError as exc:
                raise InvariantViolation("inv1", str(exc)) from None
        for layer, store in self._kept.items():
            if leaving.size:
                self._reserve_kept(store.held + leaving.size)
                slots = np.arange(store.held, store.held + leaving.size, dtype=np.int64)
                store.load(slots, *_dense(captured[layer]))
                store.held += int(leaving.size)
        if self._setup.rebuild == "step":
            self._drop_restored()
        elif leaving.size:
            self._extend_restored(captured, int(leaving.size))
        super().commit(count)
        self._check_restoration()

    # -- internals ---------------------------------------------------------------------------------------------
    def _leaving(self, before: int, count: int) -> np.ndarray:
        start = self._restoring.evicted_positions(before).size + self._restoring.sink
        end = self._restoring.evicted_positions(before + count).size + self._restoring.sink
        return np.arange(start, end, dtype=np.int64)

    def _capture(self, leaving: np.ndarray, before: int) -> dict[int, Entries[A]]:
        """K/V of the positions leaving residency, read before the commit overwrites their slots: resident ones
        read alone (a packed layer decodes only them), or as their coordinates where a coded prefix takes them."""
        offset = self.stage_offset
        resident = leaving < before
        slots = np.where(resident, self._restoring.slots_of(leaving), offset + leaving - before)
        wanted = set(self._kept)
        if self._setup.rebuild == "generation":  # recompute layers extend the restored K/V with these
            wanted |= {i for i, source in enumerate(self._plan.layers) if source.kind == "recompute"}
        all_resident = bool(resident.all())
        coded = all_resident and self._restored is not None and self._restored.coded
        captured: dict[int, Entries[A]] = {}
        for layer in wanted:
            store = self._layers[layer]
            coding = None
            if coded and layer not in self._kept and isinstance(store, PackedLayerStore):
                coding = store.held_coding(slots)
            if coding is not None:
                captured[layer] = coding
            elif all_resident:
                captured[layer] = store.gather(slots)
            else:
                keys, values = store.read(offset, offset + self._staged)
                captured[layer] = (self._ops.take(keys, slots), self._ops.take(values, slots))
        return captured

    def _reserve_kept(self, needed: int) -> None:
        if needed <= self._kept_capacity:
            return
        self._kept_capacity = max(needed, self._kept_capacity + max(self._kept_capacity // 2, 256))
        for store in self._kept.values():
            store.reserve(self._kept_capacity)

    def _extend_restored(self, captured: dict[int, Entries[A]], added: int) -> None:
        """Add the positions that just left the window to the restored K/V, as a rebuild would give them."""
        if self._restored is None:
            if self.evicted_count:  # the prefix of earlier evictions was dropped: rebuilt at the next forward
                return
            self._restored = new_prefix(self._ops, self._layers, self._restoring.sink)
        kept_new = {layer: self._kept_tail(layer, added) for layer in self._kept}
        first = self._restoring.sink + self._restored.count
        token_layers = [i for i, source in enumerate(self._plan.layers) if source.kind == "tokens"]
        rebuilt = {}
        if token_layers:
            tokens = self._tokens[first : first + added].tolist()
            rebuilt = forward_kv(
                self._forward_layers, self._ops, self.num_layers, tokens, start=first, last_layer=max(token_layers)
            )

        def forwarded(layer: int) -> Entries[A]:
            # recompute: the verifier's own K/V of these positions, computed over the restored history (exact when
            # every layer is recomputed), spare a forward over the whole prefix at every commit
            return rebuilt[layer] if self._plan.layers[layer].kind == "tokens" else captured[layer]

        end = first + added
        per_layer = [
            self._layer_kv(layer, source, first, end, kept_new.__getitem__, forwarded)
            for layer, source in enumerate(self._plan.layers)
        ]
        self._restored.extend(per_layer)
        self._note_peak()

    def _kept_tail(self, layer: int, count: int) -> tuple[A, A]:
        """The last `count` kept entries of a layer, as the store gives them back (decoded if compressed)."""
        store = self._kept[layer]
        return store.gather(np.arange(store.held - count, store.held, dtype=np.int64))

    def _rebuild(self, evicted: int) -> RestoredPrefix[A]:
        """Restored K/V of every evicted position, from the plan's state alone, one layer at a time: a layer
        forwarded over the prefix lets go of its scratch K/V once restored. A coded prefix takes a `recompute`
        layer's coordinates from the prefix forward (whose K/V are held coded, as the session's own are) and codes
        the rest `REBUILD_RUN` positions at a time, so no more than a run is dense at once."""
        sink = self._restoring.sink
        end = sink + evicted
        restored = new_prefix(self._ops, self._layers, sink)
        restored.reserve(evicted)
        layers = self._plan.forward_layers
        scratch: PrefixCache[A] | None = None
        forward: dict[int, tuple[A, A]] = {}
        if layers and self._plan.needs_prefix_forward:
            scratch = prefix_cache(
                self._forward_layers,
                self._commit,
                self._ops,
                self._tokens[:end].tolist(),
                last_layer=max(layers),
                chunk_tokens=self._chunk_tokens,
                layer_store=self._session_store if restored.coded else None,
            )
        elif layers:
            tokens = self._tokens[sink:end].tolist()
            forward = forward_kv(
                self._forward_layers, self._ops, self.num_layers, tokens, start=sink, last_layer=max(layers)
            )
        run = REBUILD_RUN if restored.coded else max(1, evicted)
        try:
            for layer, source in enumerate(self._plan.layers):
                for start in range(sink, end, run):
                    stop = min(end, start + run)
                    restored.put(layer, start - sink, self._rebuilt(layer, source, start, stop, scratch, forward))
                if scratch is not None and layer < scratch.num_layers:
                    scratch.release_layer(layer)
                forward.pop(layer, None)
        finally:
            if scratch is not None:
                scratch.release()
        restored.cover(evicted)
        self._ops.settle(restored.arrays())
        return restored

    def _rebuilt(
        self,
        layer: int,
        source: LayerSource,
        start: int,
        stop: int,
        scratch: PrefixCache[A] | None,
        forward: dict[int, tuple[A, A]],
    ) -> Entries[A]:
        """One layer's restored K/V (or their coding) of the evicted positions `[start, stop)`, from the plan's
        state and the rebuild's forward (`scratch` over the prefix, or `forward` over the evicted tokens)."""
        indices = np.arange(start - self._restoring.sink, stop - self._restoring.sink, dtype=np.int64)

        def forwarded(i: int) -> Entries[A]:
            if scratch is not None:
                return scratch.entries(i, np.arange(start, stop, dtype=np.int64))
            keys, values = forward[i]
            if indices.size == self._ops.length(keys):
                return keys, values
            return self._ops.take(keys, indices), self._ops.take(values, indices)

        return self._layer_kv(layer, source, start, stop, lambda i: self._kept[i].gather(indices), forwarded)

    def _layer_kv(
        self,
        layer: int,
        source: LayerSource,
        start: int,
        stop: int,
        kept: Callable[[int], tuple[A, A]],
        forwarded: Callable[[int], Entries[A]],
    ) -> Entries[A]:
        """One layer's restored K/V (or their coding) of the evicted positions `[start, stop)`, as its source gives
        them: `kept(i)` reads kept layer i's, `forwarded(i)` what a forward gave layer i (`tokens`, `recompute`)."""
        if source.kind == "kept":
            return kept(layer)
        if source.from_drafter:
            return self._from_contexts(source, start, stop)
        if source.kind == "projected" and source.from_layer is not None:
            return project(self._ops, source, *kept(source.from_layer))
        return forwarded(layer)

    def _from_contexts(self, source: LayerSource, start: int, end: int) -> tuple[A, A]:
        """A `projected<-drafter` layer's K/V of positions `[start, end)`, by f_θ from their context rows."""
        if self._contexts is None or source.projection is None:
            raise InvariantViolation("inv1", "a layer projects from the drafter context, which the cache lacks")
        if self._kv_like is None:
            raise InvariantViolation("inv1", "no forward has shown the layers' K/V shape yet")
        rows = source.projection.apply(self._contexts.rows(start, end))  # [P, 2*H*D]
        like = self._kv_like  # [1, H, 1, D]: the model's dtype, device and K/V heads
        out_k, out_v = rows_kv(rows, int(like.shape[1]), int(like.shape[3]))  # type: ignore[attr-defined]
        return self._ops.from_host(out_k, like), self._ops.from_host(out_v, like)

    def stage_layer_parts(self, layer_idx: int, keys: A, values: A) -> tuple[KeyPart[A], ...]:
        if self._contexts is not None and self._kv_like is None:
            self._kv_like = self._ops.take(keys, np.zeros(1, dtype=np.int64))  # one position's K, kept for shapes
        return super().stage_layer_parts(layer_idx, keys, values)

    def _drop_restored(self) -> None:
        self._restored = None
        self.attach_prefix(None)

    def _note_peak(self) -> None:
        self._peak_restored_bytes = max(self._peak_restored_bytes, self._restored_bytes())

    def _check_restoration(self) -> None:
        """INV-1 for the restoration state: every kept layer (and the restored K/V, when held) covers exactly the
        evicted positions; the token ids cover the committed ones."""
        evicted = self.evicted_count
        for layer, store in self._kept.items():
            if store.held != evicted:
                raise InvariantViolation("inv1", f"kept layer {layer} holds {store.held} K/V, {evicted} are evicted")
        if self._restored is not None and self._restored.count != evicted:
            raise InvariantViolation("inv1", f"{self._restored.count} positions restored, {evicted} are evicted")
        if self._plan.needs_tokens and self._tokens.size != self.next_position:
            raise InvariantViolation("inv1", f"{self._tokens.size} token ids kept for {self.next_position} positions")

    def clone(self, length: int) -> RestoringSessionCache[A]:
        """An independent copy holding what this cache would hold after `length` committed positions (the
        restoration state of positions evicted by then included)."""
        resident = super().clone(length)
        meta = resident.meta_state
        twin = RestoringSessionCache(
            self._restoring,
            num_layers=self.num_layers,
            ops=self._ops,
            forward_layers=self._forward_layers,
            commit=self._commit,
            chunk_tokens=self._chunk_tokens,
            setup=self._setup,
            layer_store=self._session_store,
        )
        twin._restore(resident.state, np.asarray(meta["positions"], dtype=np.int64), length)
        resident.release()
        evicted = self._restoring.evicted_positions(length).size
        twin._reserve_kept(evicted)
        slots = np.arange(evicted, dtype=np.int64)
        for layer, store in self._kept.items():
            if evicted:  # in the form the store holds them: packed codes are copied, not decoded and encoded again
                twin._kept[layer].load_from(store, slots, slots)
            twin._kept[layer].held = evicted
        if self._plan.needs_tokens:
            twin._tokens = self._tokens[:length].copy()
        if self._contexts is not None:
            twin._contexts = self._contexts.clone(length)
            twin._kv_like = self._kv_like
        twin._check_restoration()
        return twin


def _dense(entries: Entries[A]) -> tuple[A, A]:
    """Captured K/V a kept layer stores (never taken as coordinates)."""
    if not isinstance(entries, tuple):
        raise InvariantViolation("inv1", "a kept layer was handed coordinates instead of K/V")
    return entries
