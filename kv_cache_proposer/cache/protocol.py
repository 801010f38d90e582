"""The contract of a session cache, as the decoder, the daemon, the proposers and the backends use it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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

    def layer(self, layer_idx: int) -> KeyPart[A_co]:
        """Keys and values `[B, H, P, D]` of one layer: dense, or held compactly."""
        ...


@dataclass(frozen=True, slots=True)
class CacheFootprint:
    """What a session cache holds, in positions and bytes (`SessionCache.footprint`)."""

    resident_count: int = 0  # positions whose K/V are resident
    evicted_count: int = 0  # committed positions no longer resident
    lost_count: int = 0  # committed positions whose K/V no forward reads any more (evicted and not restored)
    restored_count: int = 0  # evicted positions whose restored K/V are held now
    nbytes: int = 0  # bytes held now: resident K/V, restoration state and restored K/V together
    working_bytes: int = 0  # the part of `nbytes` held only while the session generates, freed by `park()`
    compressed_bytes: int = 0  # bytes of compressed K/V payload (0: an uncompressed cache)
    dense_equivalent_bytes: int = 0  # bytes the resident K/V would take dense, in the model's dtype
    escaped_vectors: int = 0  # resident vectors a compressed cache holds uncompressed (its code cannot hold them)
    restored_bytes: int = 0  # bytes of restored K/V of evicted positions held now (transient)
    peak_restored_bytes: int = 0  # the most bytes of restored K/V held at once so far
    forward_bytes: int = 0  # bytes held as its last forward ended, its stage not yet committed (0 once parked)
    restoration_state_bytes: int = 0  # bytes of per-position state kept to restore evicted positions
    history_token_bytes: int = 0  # bytes of history token ids kept to rebuild evicted K/V by a forward


@dataclass(frozen=True, slots=True)
class ModelCall:
    """The model call in flight over a cache: the positions it queries and the keys its attention reads."""

    query_positions: np.ndarray  # [n] global positions of the queries
    key_positions: np.ndarray  # [K] global positions of the keys read, in order (-1: an empty slot)
    query_offset: int  # global position of the first query
    keys_before_queries: int  # keys read ahead of the queries' own
    own_keys: int  # keys after the stage, the queries' K/V as computed, each read by its own query only
    prefix_keys: int  # keys read ahead of the cache's own slots (K/V of positions not resident)


class HeldKeys(Protocol[A_co]):
    """Keys and values of a run of slots held in a compact form (lattice coordinates, say), which attention reads a
    chunk at a time instead of as one dense copy."""

    @property
    def length(self) -> int:
        """Number of keys."""
        ...

    def dense(self) -> tuple[A_co, A_co]:
        """The keys and values `[B, H, length, D]` as dense arrays (a transient copy, for a reader that needs one)."""
        ...


KeyPart = tuple[A, A] | HeldKeys[A]
"""A run of the keys a model call reads, in the order of `ModelCall.key_positions`: dense keys and values
`[B, H, c, D]`, or keys held compactly."""


NO_CALL = ModelCall(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 0, 0, 0, 0)


class SessionCache(Protocol[A]):
    """The contract of a per-session K/V cache, as the decoder, the daemon and the backends use it.

    A forward calls `begin_stage` for its block, then `stage_layer` for every layer, which returns what that
    layer's attention reads (the keys of `call`); `commit` makes a prefix of the stage resident and drops the rest.
    Copies and snapshots of a cache are in `cache.snapshot`.
    """

    @property
    def strategy(self) -> KVStrategy: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def next_position(self) -> int:
        """Global position of the next committed token (= number of committed positions)."""
        ...

    def footprint(self) -> CacheFootprint:
        """What the cache holds now, in positions and bytes."""
        ...

    def park(self) -> None:
        """The session stops generating for now: drop working copies so it holds only its resident storage."""
        ...

    def rest(self) -> bool:
        """As `park`, but a layer that holds its residents in a form that is also a resident form while the session
        generates (a compressed layer's lattice coordinates) keeps them so: the next generation starts without
        unpacking, at more bytes than `park` leaves. Whether any layer did; `park` later turns them back."""
        ...

    def expect(self, positions: int) -> None:
        """Until it parks the cache takes at most `positions` more positions (a generation's pending tokens and
        those it may still generate): growing, it reserves no room beyond them."""
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
    def call(self) -> ModelCall:
        """The model call in flight (selected by `begin_stage` / `select_queries`; `NO_CALL` after a commit)."""
        ...

    def begin_stage(self, block_len: int, *, extend: bool = False, token_ids: Sequence[int] = ()) -> None:
        """Reserve the stage for a block at the next positions and select all of it for the next model call.

        With `extend` the block goes after what the previous forward staged (and sees it); otherwise the previous
        stage is dropped. `token_ids` are the block's tokens, for a cache that rebuilds K/V from them; an extension
        may leave them to `name_stage`.
        """
        ...

    def name_stage(self, token_ids: Sequence[int]) -> None:
        """The token ids of every staged position, in order: a burst stages each pick before the host knows it and
        names them all at its end, before the commit (a cache that keeps no ids ignores them)."""
        ...

    def select_queries(self, start: int, end: int) -> None:
        """Make block positions `[start, end)` the part the next model call processes (a block may be staged by
        several consecutive model calls; a later part reads the earlier parts' staged K/V)."""
        ...

    def stage_layer(self, layer_idx: int, keys: A, values: A) -> tuple[A, A]:
        """Stage one layer's K/V `[B, H, n, D]` for the model call in flight; returns what its attention reads
        `[B, H, K, D]`, in the order of `call.key_positions`."""
        ...

    def stage_layer_parts(self, layer_idx: int, keys: A, values: A) -> tuple[KeyPart[A], ...]:
        """`stage_layer`, returning what attention reads as consecutive parts (dense or held compactly) whose keys,
        joined, are `stage_layer`'s; a forward that reads the parts one at a time never holds the history dense."""
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

    def release(self) -> None:
        """Free the storage. The cache must not be used afterwards."""
        ...
