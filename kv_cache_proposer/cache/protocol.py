"""The contract of a session cache, as the decoder, the daemon, the proposers and the backends use it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

import numpy as np

from kv_cache_proposer.cache.arrays import A
from kv_cache_proposer.strategies import KVStrategy

A_co = TypeVar("A_co", covariant=True)


class AttentionPrefix(Protocol[A_co]):
    """K/V read by attention ahead of a cache's own slots, at their global positions."""

    @property
    def positions(self) -> np.ndarray:
        """Global positions of the prefix keys `[P]`, the same for every layer."""
        ...

    def layer(self, layer_idx: int) -> tuple[A_co, A_co]:
        """Keys and values `[B, H, P, D]` of one layer."""
        ...


class SessionCache(Protocol[A]):
    """The contract of a per-session K/V cache, as the decoder, the daemon and the backends use it.

    A forward calls `begin_stage` for its block, then `stage_layer` for every layer, which returns what that
    layer's attention reads; `commit` makes a prefix of the stage resident and drops the rest.
    """

    @property
    def strategy(self) -> KVStrategy: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def next_position(self) -> int:
        """Global position of the next committed token (= number of committed positions)."""
        ...

    @property
    def resident_count(self) -> int:
        """Positions whose K/V are resident."""
        ...

    @property
    def evicted_count(self) -> int:
        """Committed positions no longer resident."""
        ...

    @property
    def lost_count(self) -> int:
        """Committed positions whose K/V no forward reads any more (evicted and not restored)."""
        ...

    @property
    def restored_count(self) -> int:
        """Evicted positions whose restored K/V are held now."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds now (resident K/V, restoration state and restored K/V together)."""
        ...

    @property
    def working_bytes(self) -> int:
        """The part of `nbytes` held only while the session generates, freed by `park()` (a compressed cache's
        decoded working copy)."""
        ...

    @property
    def restored_bytes(self) -> int:
        """Bytes of restored K/V of evicted positions held now (transient)."""
        ...

    @property
    def peak_restored_bytes(self) -> int:
        """The most bytes of restored K/V held at once so far."""
        ...

    @property
    def restoration_state_bytes(self) -> int:
        """Bytes of the per-position state kept to restore evicted positions (K/V of kept layers)."""
        ...

    @property
    def history_token_bytes(self) -> int:
        """Bytes of the history's token ids the cache keeps to rebuild evicted K/V by a forward."""
        ...

    @property
    def restoration_feature_layers(self) -> tuple[int, ...]:
        """Model layers whose outputs every forward over this cache hands to `take_features` (empty: none)."""
        ...

    def take_features(self, features: np.ndarray) -> None:
        """The outputs `[n, L*H]` (host) of `restoration_feature_layers` for the positions of the model call in
        flight."""
        ...

    @property
    def compressed_bytes(self) -> int:
        """Bytes of compressed K/V payload (0 for an uncompressed cache)."""
        ...

    @property
    def dense_equivalent_bytes(self) -> int:
        """Bytes the resident K/V would take dense, in the model's dtype."""
        ...

    @property
    def escaped_vectors(self) -> int:
        """Resident K/V vectors a compressed cache holds uncompressed (its code cannot represent them)."""
        ...

    def park(self) -> None:
        """The session stops generating for now: drop working copies so it holds only its resident storage."""
        ...

    @property
    def query_positions(self) -> np.ndarray:
        """Global positions of the queries of the model call in flight `[n]`."""
        ...

    @property
    def key_positions(self) -> np.ndarray:
        """Global positions of the keys the model call in flight reads (-1: an empty slot) `[K]`."""
        ...

    @property
    def query_offset(self) -> int:
        """Global position of the first query of the model call in flight."""
        ...

    @property
    def keys_before_queries(self) -> int:
        """Keys the model call in flight reads ahead of its own queries."""
        ...

    @property
    def own_keys(self) -> int:
        """Keys the model call in flight reads after its own queries, the last of `key_positions`: the queries' K/V
        as computed, each read by its own query only (a lossy cache's call over several queries; else 0)."""
        ...

    @property
    def prefix(self) -> AttentionPrefix[A] | None:
        """The parts read ahead of the cache's own slots, if any."""
        ...

    def attach_prefix(self, prefix: AttentionPrefix[A] | None) -> None:
        """Read `prefix` ahead of the cache's own slots in every forward from now on (None: stop)."""
        ...

    def begin_stage(self, block_len: int, *, extend: bool = False, token_ids: Sequence[int] = ()) -> None:
        """Reserve the stage for a block at the next positions and select all of it for the next model call.

        With `extend` the block goes after what the previous forward staged (and sees it); otherwise the previous
        stage is dropped. `token_ids` are the block's tokens, for a cache that rebuilds K/V from them.
        """
        ...

    def select_queries(self, start: int, end: int) -> None:
        """Make block positions `[start, end)` the part the next model call processes (a block may be staged by
        several consecutive model calls; a later part reads the earlier parts' staged K/V)."""
        ...

    def stage_layer(self, layer_idx: int, keys: A, values: A) -> tuple[A, A]:
        """Stage one layer's K/V `[B, H, n, D]` for the model call in flight; returns what its attention reads
        `[B, H, K, D]`, in the order of `key_positions`."""
        ...

    def commit(self, count: int) -> None:
        """Make the first `count` staged positions resident, drop the rest of the stage and evict per strategy.

        Raises `InvariantViolation` when the bookkeeping and the K/V held disagree afterwards.
        """
        ...

    def arrays(self) -> list[A]:
        """Every array the cache holds (to evaluate a forward's writes together with its outputs)."""
        ...

    def resident_kv(self, layer_idx: int) -> tuple[A, A, np.ndarray]:
        """Resident (keys, values, positions) of one layer, ordered by position: `[B, H, R, D]` x2 and `[R]`."""
        ...

    def clone(self, length: int) -> SessionCache[A]:
        """An independent cache holding what this one would hold had it committed only `length` positions.

        Raises `ValueError` when positions the copy needs were already evicted here.
        """
        ...

    def release(self) -> None:
        """Free the storage. The cache must not be used afterwards."""
        ...
