"""A `dlm_restore` session's restoration state, and the restored K/V built from it.

The state is what the plan keeps of every evicted position: the K/V of `kept` layers (in the session's layer store,
so through its compressor), the token ids when a layer is rebuilt by a forward, and the drafter context rows when a
layer is projected from them. `rebuild` turns it into the `RestoredPrefix` of every evicted position; `extend` adds
the positions that just left the window to a prefix already built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic

import numpy as np

from kv_cache_proposer.cache.arrays import A, ArrayOps
from kv_cache_proposer.cache.layer_store import LayerStore, LayerStoreFactory
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
from kv_cache_proposer.restoration.setup import REBUILD_RUN


class RestorationState(Generic[A]):
    """The plan's state of a session's evicted positions (past the `sink`), and how restored K/V come from it."""

    def __init__(
        self,
        plan: RestorationPlan,
        *,
        sink: int,
        num_layers: int,
        ops: ArrayOps[A],
        forward_layers: LayerForward[A],
        commit: LayerCommit[A],
        chunk_tokens: int,
        kept_store: LayerStoreFactory[A],
        session_store: LayerStoreFactory[A] | None,
        dense_store: LayerStoreFactory[A],
    ) -> None:
        self.plan = plan
        self._sink = sink
        self._num_layers = num_layers
        self._ops = ops
        self._forward_layers = forward_layers  # the verifier's first layers: `tokens` and `recompute` rebuilds
        self._commit = commit  # the verifier's commit of a rebuild's prefix chunk
        self._chunk_tokens = chunk_tokens  # the most tokens a rebuild forward takes
        self._session_store = session_store  # codes a rebuild's prefix forward when the restored K/V are coded
        self._dense_store = dense_store  # holds restored K/V and a rebuild's prefix forward otherwise
        self.kept: dict[int, LayerStore[A]] = {layer: kept_store(ops) for layer in plan.kept_layers}
        self._kept_capacity = 0
        self.tokens = np.zeros(0, dtype=np.int32)  # committed token ids, when a layer is rebuilt from them
        drafter = plan.drafter if plan.uses_drafter else None
        # The drafter context rows of committed positions past the sink, for `projected<-drafter` layers.
        self.contexts = None if drafter is None else ContextStore(drafter, sink)
        self.kv_like: A | None = None  # one position's K `[1, H, 1, D]`, for K/V built on the host

    @property
    def nbytes(self) -> int:
        """Bytes of the kept layers' K/V of evicted positions (exactly what they need while parked), plus the
        drafter context rows of every committed position past the sink when a layer is projected from them. The
        token ids are counted apart (`tokens`)."""
        contexts = 0 if self.contexts is None else self.contexts.nbytes
        return sum(store.nbytes for store in self.kept.values()) + contexts

    # -- the drafter context rows of a forward (`projected<-drafter` layers; nothing to do without one) ------------
    def begin_stage(self, block_len: int, *, extend: bool) -> None:
        if self.contexts is not None:
            self.contexts.begin_stage(block_len, extend=extend)

    def see_keys(self, keys: A) -> None:
        """Keep one position of a forward's staged K (`kv_like`), whose shape f_θ's K/V take."""
        if self.contexts is not None and self.kv_like is None:
            self.kv_like = self._ops.take(keys, np.zeros(1, dtype=np.int64))

    def stage_features(self, start: int, features: np.ndarray) -> None:
        if self.contexts is not None:
            self.contexts.stage_features(start, features)

    def commit_contexts(self, next_position: int, count: int) -> None:
        if self.contexts is None:
            return
        try:
            self.contexts.commit(next_position, count)
        except ValueError as exc:
            raise InvariantViolation("inv1", str(exc)) from None

    # -- what a commit adds ------------------------------------------------------------------------------------
    def add_tokens(self, token_ids: Sequence[int]) -> None:
        self.tokens = np.concatenate([self.tokens, np.asarray(token_ids, dtype=np.int32)])

    def keep(self, captured: dict[int, Entries[A]], count: int) -> None:
        """Store the `count` positions leaving the window in every kept layer, after those evicted before."""
        for layer, store in self.kept.items():
            self.reserve_kept(store.held + count)
            slots = np.arange(store.held, store.held + count, dtype=np.int64)
            store.load(slots, *_dense(captured[layer]))
            store.held += count

    def reserve_kept(self, needed: int) -> None:
        if needed <= self._kept_capacity:
            return
        self._kept_capacity = max(needed, self._kept_capacity + max(self._kept_capacity // 2, 256))
        for store in self.kept.values():
            store.reserve(self._kept_capacity)

    def park(self, evicted: int) -> None:
        """Drop the spare capacity: each store keeps exactly the `evicted` positions (one copy per generation)."""
        for store in self.kept.values():
            store.park(evicted)
        self._kept_capacity = min(self._kept_capacity, evicted)
        if self.contexts is not None:
            self.contexts.trim()

    def release(self) -> None:
        for store in self.kept.values():
            store.release()
        self.tokens = np.zeros(0, dtype=np.int32)

    def copy_into(self, twin: RestorationState[A], length: int, evicted: int) -> None:
        """Give `twin` (of the same plan, empty) this state as it stood after `length` committed positions, of which
        `evicted` had left the window: packed codes are copied as they are, not decoded and coded again."""
        twin.reserve_kept(evicted)
        slots = np.arange(evicted, dtype=np.int64)
        for layer, store in self.kept.items():
            if evicted:
                twin.kept[layer].load_from(store, slots, slots)
            twin.kept[layer].held = evicted
        if self.plan.needs_tokens:
            twin.tokens = self.tokens[:length].copy()
        if self.contexts is not None:
            twin.contexts = self.contexts.clone(length)
            twin.kv_like = self.kv_like

    def check(self, evicted: int, committed: int) -> None:
        """INV-1: every kept layer covers exactly the evicted positions; the token ids cover the committed ones."""
        for layer, store in self.kept.items():
            if store.held != evicted:
                raise InvariantViolation("inv1", f"kept layer {layer} holds {store.held} K/V, {evicted} are evicted")
        if self.plan.needs_tokens and self.tokens.size != committed:
            raise InvariantViolation("inv1", f"{self.tokens.size} token ids kept for {committed} positions")

    # -- restored K/V ------------------------------------------------------------------------------------------
    def new_prefix(self, resident: Sequence[LayerStore[A]]) -> RestoredPrefix[A]:
        """An empty restored prefix for a session whose residents are `resident` (`rebuild.new_prefix`)."""
        return new_prefix(self._ops, resident, self._sink, self._dense_store)

    def rebuild(self, evicted: int, resident: Sequence[LayerStore[A]]) -> RestoredPrefix[A]:
        """Restored K/V of every evicted position, from the state alone, one layer at a time: a layer forwarded over
        the prefix lets go of its scratch K/V once restored. A coded prefix (`resident` layers held as lattice
        coordinates) takes a `recompute` layer's coordinates from the prefix forward (whose K/V are held coded, as
        the session's own are) and codes the rest `REBUILD_RUN` positions at a time, so no more than a run is dense
        at once."""
        sink = self._sink
        end = sink + evicted
        restored = self.new_prefix(resident)
        restored.reserve(evicted)
        layers = self.plan.forward_layers
        scratch: PrefixCache[A] | None = None
        forward: dict[int, tuple[A, A]] = {}
        if layers and self.plan.needs_prefix_forward:
            scratch = prefix_cache(
                self._forward_layers,
                self._commit,
                self._ops,
                self.tokens[:end].tolist(),
                last_layer=max(layers),
                chunk_tokens=self._chunk_tokens,
                layer_store=self._session_store if restored.coded else self._dense_store,
            )
        elif layers:
            tokens = self.tokens[sink:end].tolist()
            forward = forward_kv(
                self._forward_layers, self._ops, self._num_layers, tokens, start=sink, last_layer=max(layers)
            )
        run = REBUILD_RUN if restored.coded else max(1, evicted)
        try:
            for layer, source in enumerate(self.plan.layers):
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

    def extend(self, restored: RestoredPrefix[A], captured: dict[int, Entries[A]], added: int) -> None:
        """Add the `added` positions that just left the window (and were just kept) to `restored`, as a rebuild
        would give them; `captured` holds their K/V as the resident layers held them."""
        kept_new = {layer: self._kept_tail(layer, added) for layer in self.kept}
        first = self._sink + restored.count
        token_layers = [i for i, source in enumerate(self.plan.layers) if source.kind == "tokens"]
        rebuilt = {}
        if token_layers:
            tokens = self.tokens[first : first + added].tolist()
            rebuilt = forward_kv(
                self._forward_layers, self._ops, self._num_layers, tokens, start=first, last_layer=max(token_layers)
            )

        def forwarded(layer: int) -> Entries[A]:
            # recompute: the verifier's own K/V of these positions, computed over the restored history (exact when
            # every layer is recomputed), spare a forward over the whole prefix at every commit
            return rebuilt[layer] if self.plan.layers[layer].kind == "tokens" else captured[layer]

        end = first + added
        per_layer = [
            self._layer_kv(layer, source, first, end, kept_new.__getitem__, forwarded)
            for layer, source in enumerate(self.plan.layers)
        ]
        restored.extend(per_layer)

    def _kept_tail(self, layer: int, count: int) -> tuple[A, A]:
        """The last `count` kept entries of a layer, as the store gives them back (decoded if compressed)."""
        store = self.kept[layer]
        return store.gather(np.arange(store.held - count, store.held, dtype=np.int64))

    def _rebuilt(
        self,
        layer: int,
        source: LayerSource,
        start: int,
        stop: int,
        scratch: PrefixCache[A] | None,
        forward: dict[int, tuple[A, A]],
    ) -> Entries[A]:
        """One layer's restored K/V (or their coding) of the evicted positions `[start, stop)`, from the state and
        the rebuild's forward (`scratch` over the prefix, or `forward` over the evicted tokens)."""
        indices = np.arange(start - self._sink, stop - self._sink, dtype=np.int64)

        def forwarded(i: int) -> Entries[A]:
            if scratch is not None:
                return scratch.entries(i, np.arange(start, stop, dtype=np.int64))
            keys, values = forward[i]
            if indices.size == self._ops.length(keys):
                return keys, values
            return self._ops.take(keys, indices), self._ops.take(values, indices)

        return self._layer_kv(layer, source, start, stop, lambda i: self.kept[i].gather(indices), forwarded)

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
            return project(self._ops, source, *kept(source.from_layer), np.arange(start, stop, dtype=np.int64))
        return forwarded(layer)

    def _from_contexts(self, source: LayerSource, start: int, end: int) -> tuple[A, A]:
        """A `projected<-drafter` layer's K/V of positions `[start, end)`, by f_θ from their context rows."""
        if self.contexts is None or source.projection is None:
            raise InvariantViolation("inv1", "a layer projects from the drafter context, which the cache lacks")
        if self.kv_like is None:
            raise InvariantViolation("inv1", "no forward has shown the layers' K/V shape yet")
        positions = np.arange(start, end, dtype=np.int64)
        rows = source.projection.apply(self.contexts.rows(start, end), positions)  # [P, 2*H*D]
        like = self.kv_like  # [1, H, 1, D]: the model's dtype, device and K/V heads
        out_k, out_v = rows_kv(rows, int(like.shape[1]), int(like.shape[3]))  # type: ignore[attr-defined]
        return self._ops.from_host(out_k, like), self._ops.from_host(out_v, like)


def _dense(entries: Entries[A]) -> tuple[A, A]:
    """Captured K/V a kept layer stores (never taken as coordinates)."""
    if not isinstance(entries, tuple):
        raise InvariantViolation("inv1", "a kept layer was handed coordinates instead of K/V")
    return entries
