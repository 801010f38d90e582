"""The `dlm_restore` session cache: sink + window resident, every evicted position restored for each forward.

Between generations the cache holds its resident K/V plus the plan's per-position state of the evicted positions
(the K/V of `kept` layers, through the session's layer store and so its compressor, and the token ids when a layer
is rebuilt by a forward). Before a forward it makes sure a `RestoredPrefix` covers every evicted position and reads
it ahead of the resident slots at the positions' true global positions:

- rebuild `generation`: the prefix is rebuilt from the state when a generation starts and then extended at each
  commit with the positions that leave the window; `park()` drops it.
- rebuild `step`: the prefix is rebuilt from the state before every forward and dropped after its commit.

Positions leaving the window are captured at commit, before their slots are overwritten, and handed to the
`RestorationState` (restoration/state.py), which keeps what the plan needs of them and builds the restored K/V. A
session whose resident layers are held as lattice coordinates while it generates holds its restored K/V so too
(`new_prefix`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kv_cache_proposer.cache.arrays import A, ArrayOps
from kv_cache_proposer.cache.layer_store import DenseLayerStore, LayerStoreFactory
from kv_cache_proposer.cache.protocol import CacheFootprint, KeyPart
from kv_cache_proposer.cache.session import KVSessionCache
from kv_cache_proposer.compression.packed_store import PackedLayerStore
from kv_cache_proposer.errors import InvariantViolation
from kv_cache_proposer.restoration.plan import RestorationPlan
from kv_cache_proposer.restoration.rebuild import Entries, LayerCommit, LayerForward, RestoredPrefix
from kv_cache_proposer.restoration.setup import RestorationSetup
from kv_cache_proposer.restoration.state import RestorationState
from kv_cache_proposer.strategies import DlmRestoreStrategy


class RestoringSessionCache(KVSessionCache[A]):
    """`KVSessionCache` under `dlm_restore`: resident sink + window, restored K/V of every evicted position."""

    stage_read_once = False  # a commit reads the K/V of the positions that leave residency from the stage

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
        dense_store: LayerStoreFactory[A] | None = None,
        key_block: int | None = None,
    ) -> None:
        """`layer_store`: what holds the session's K/V (a compressor's store, say); `dense_store`: what holds K/V
        kept or restored dense (None: `DenseLayerStore` in the model's dtype), the residents too without a
        `layer_store`."""
        dense: LayerStoreFactory[A] = dense_store or DenseLayerStore
        super().__init__(
            strategy, num_layers=num_layers, ops=ops, layer_store=layer_store or dense, key_block=key_block
        )
        self._restoring = strategy
        self._forward_layers = forward_layers
        self._commit = commit
        self._chunk_tokens = chunk_tokens
        self._setup = setup
        self._session_store = layer_store  # the session's own store (None: dense), which a clone gets too
        self._dense_store = dense
        self._plan = setup.plan_for(num_layers)
        self._state: RestorationState[A] = RestorationState(
            self._plan,
            sink=strategy.sink,
            num_layers=num_layers,
            ops=ops,
            forward_layers=forward_layers,
            commit=commit,
            chunk_tokens=chunk_tokens,
            # kept layers go through the session's compressor when it has one, else through the plan's
            kept_store=layer_store or setup.kept_store or dense,
            session_store=layer_store,
            dense_store=dense,
        )
        self._stage_tokens: list[int] = []
        self._restored: RestoredPrefix[A] | None = None
        self._restored_horizon: int | None = None  # the evicted positions this generation may reach (`expect`)
        self._peak_restored_bytes = 0

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

    @property
    def nbytes(self) -> int:
        return self.resident_bytes + self._state.nbytes + int(self._state.tokens.nbytes) + self._restored_bytes()

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
            restoration_state_bytes=self._state.nbytes,
            history_token_bytes=int(self._state.tokens.nbytes),
        )

    @property
    def restoration_feature_layers(self) -> tuple[int, ...]:
        """Verifier layers whose outputs a forward must hand to `take_features` (the drafter context's inputs)."""
        return self._plan.feature_layers

    def take_features(self, features: np.ndarray) -> None:
        """The outputs `[n, L*H]` (host) of `restoration_feature_layers` for the positions of the model call in
        flight."""
        self._state.stage_features(self._query_start, features)

    def arrays(self) -> list[A]:
        held = super().arrays() + [array for store in self._state.kept.values() for array in store.arrays()]
        return held if self._restored is None else held + self._restored.arrays()

    def expect(self, positions: int) -> None:
        """As the resident cache's; the restored K/V too grow no further than the generation can evict (each
        position it commits evicts at most one)."""
        super().expect(positions)
        self._restored_horizon = self.evicted_count + positions
        if self._restored is not None:
            self._restored.bound(self._restored_horizon)

    def park(self) -> None:
        """Drop the restored K/V and the spare capacity of the kept layers: a parked session holds its resident
        K/V and exactly the plan's state of its evicted positions."""
        self._drop_restored()
        self._restored_horizon = None
        self._state.park(self.evicted_count)
        super().park()

    def rest(self) -> bool:
        """A restoring cache parks: its kept layers' state is what its plan keeps."""
        self.park()
        return False

    def release(self) -> None:
        self._drop_restored()
        self._state.release()
        super().release()

    # -- forwards ----------------------------------------------------------------------------------------------
    def begin_stage(self, block_len: int, *, extend: bool = False, token_ids: Sequence[int] = ()) -> None:
        named = len(token_ids) == block_len or (extend and not token_ids)  # a burst names its picks at its end
        if self._plan.needs_tokens and not named:
            raise ValueError(f"dlm_restore rebuilds K/V from token ids: {len(token_ids)} for a block of {block_len}")
        self._stage_tokens = [*self._stage_tokens, *token_ids] if extend else list(token_ids)
        evicted = self.evicted_count
        if evicted and (self._restored is None or self._restored.count != evicted):
            self._hold_restored(self._state.rebuild(evicted, self._layers))
            self._note_peak()
        self.attach_prefix(self._restored)
        super().begin_stage(block_len, extend=extend)
        self._state.begin_stage(block_len, extend=extend)

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
            self._state.add_tokens(self._stage_tokens[:count])
        self._stage_tokens = []
        self._state.commit_contexts(before, count)
        if leaving.size:
            self._state.keep(captured, int(leaving.size))
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
        wanted = set(self._state.kept)
        if self._setup.rebuild == "generation":  # recompute layers extend the restored K/V with these
            wanted |= {i for i, source in enumerate(self._plan.layers) if source.kind == "recompute"}
        all_resident = bool(resident.all())
        coded = all_resident and self._restored is not None and self._restored.coded
        captured: dict[int, Entries[A]] = {}
        for layer in wanted:
            store = self._layers[layer]
            coding = None
            if coded and layer not in self._state.kept and isinstance(store, PackedLayerStore):
                coding = store.held_coding(slots)
            if coding is not None:
                captured[layer] = coding
            elif all_resident:
                captured[layer] = store.gather(slots)
            else:
                keys, values = store.read(offset, offset + self._staged)
                captured[layer] = (self._ops.take(keys, slots), self._ops.take(values, slots))
        return captured

    def _extend_restored(self, captured: dict[int, Entries[A]], added: int) -> None:
        """Add the positions that just left the window to the restored K/V, as a rebuild would give them."""
        restored = self._restored
        if restored is None:
            if self.evicted_count:  # the prefix of earlier evictions was dropped: rebuilt at the next forward
                return
            restored = self._hold_restored(self._state.new_prefix(self._layers))
        self._state.extend(restored, captured, added)
        self._note_peak()

    def stage_layer_parts(self, layer_idx: int, keys: A, values: A) -> tuple[KeyPart[A], ...]:
        self._state.see_keys(keys)
        return super().stage_layer_parts(layer_idx, keys, values)

    def _hold_restored(self, prefix: RestoredPrefix[A]) -> RestoredPrefix[A]:
        """Hold `prefix` as the restored K/V, grown no further than this generation can evict (`expect`)."""
        prefix.bound(self._restored_horizon)
        self._restored = prefix
        return prefix

    def _drop_restored(self) -> None:
        self._restored = None
        self.attach_prefix(None)

    def _note_peak(self) -> None:
        self._peak_restored_bytes = max(self._peak_restored_bytes, self._restored_bytes())

    def _check_restoration(self) -> None:
        """INV-1 for the restoration state: every kept layer (and the restored K/V, when held) covers exactly the
        evicted positions; the token ids cover the committed ones."""
        evicted = self.evicted_count
        self._state.check(evicted, self.next_position)
        if self._restored is not None and self._restored.count != evicted:
            raise InvariantViolation("inv1", f"{self._restored.count} positions restored, {evicted} are evicted")

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
            dense_store=self._dense_store,
            key_block=self._key_block,
        )
        twin._restore(resident.state, np.asarray(meta["positions"], dtype=np.int64), length)
        resident.release()
        self._state.copy_into(twin._state, length, self._restoring.evicted_positions(length).size)
        twin._check_restoration()
        return twin
