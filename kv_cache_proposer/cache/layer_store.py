"""What one layer of a session cache stores, behind a small interface, and the dense store.

A layer store holds the K/V of a layer's slots: resident slots `[0, stage_offset)` addressed by the session
cache's slot table, then the stage, where a forward writes the K/V of its block. Attention reads resident slots
and stage together; a commit turns accepted staged entries into resident ones. A store may keep resident entries
in any form (dense, packed) as long as `read` hands attention dense K/V; the stage is always written dense.

A lossy store (one whose held entries differ from the K/V a forward computed) lets every query read its own
position as computed and every other position as held, so a token's K/V read by a later position never depends on
which forward computed it. A forward over one query stages its K/V as computed, and the store may turn them into
their held form as late as the commit or the next forward (`finish_stages`: every layer of a cache at once). A
forward over n > 1 queries stages the held form, for the later queries, and `read` appends the n entries as computed
after the stage: attention reads those `own_keys`, each by its own query only (see `ModelCall.own_keys`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, runtime_checkable

import numpy as np

from kv_cache_proposer.cache.arrays import A, ArrayOps
from kv_cache_proposer.cache.protocol import KeyPart


@dataclass(frozen=True, slots=True)
class CommitPlan:
    """Where a commit puts the accepted staged entries of a layer.

    The first `count` stage entries are accepted. When `slots` is None they become resident where they were
    staged (stage index i is slot `stage_offset + i`); otherwise the entries at stage indices `sources` move to
    `slots`, and the other accepted entries were overtaken by later positions within the same commit.
    """

    stage_offset: int
    count: int
    slots: np.ndarray | None  # [m] destination slots
    sources: np.ndarray | None  # [m] stage indices
    newly_held: int  # slots that held nothing before the commit
    source_slots: np.ndarray | None = None  # [m] `stage_offset + sources`: where the moving entries were staged


@dataclass(frozen=True, slots=True)
class StoreFootprint:
    """How a layer store holds its resident entries, for byte accounting."""

    compressed_bytes: int  # bytes of a compressed form (0: the store does not compress)
    dense_equivalent_bytes: int  # bytes the resident entries would take dense, in the model's dtype
    escaped_vectors: int  # vectors a compressed form holds uncompressed because its code cannot represent them


class LayerStore(Protocol[A]):
    """One layer's K/V: resident slots, then a dense stage."""

    held: int
    """Resident entries the layer holds; checked against the slot table after every commit (INV-1)."""

    lossy: bool
    """Whether held entries differ from the K/V a forward computed (then a forward over n > 1 queries reads its
    block twice, see the module docstring)."""

    @classmethod
    def start_stages(cls, stores: Sequence[LayerStore[A]]) -> None:
        """Begin what `stores` (stores of this class, the layers of one cache) leave of a forward's work, once the
        forward's last layer has staged its K/V; it may run beside the rest of the forward, and changes nothing a
        read returns until `finish_stages`."""
        ...

    @classmethod
    def finish_stages(cls, stores: Sequence[LayerStore[A]]) -> None:
        """Finish what `stores` (stores of this class, the layers of one cache) left of their forwards' work, all
        together: before a commit, and before a forward that extends the stage."""
        ...

    @property
    def active(self) -> bool:
        """Whether the layer has received any K/V (a model may leave some layers without a cache)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes the layer holds now."""
        ...

    def working_nbytes(self, slots: int) -> int:
        """The part of `nbytes` held only while the session generates, which `park(slots)` frees: what only speeds
        up forwards, and the room beyond the first `slots` slots."""
        ...

    def footprint(self) -> StoreFootprint:
        """Compressed and dense-equivalent bytes of the resident entries."""
        ...

    def arrays(self) -> list[A]:
        """The arrays a forward or commit may have left to compute: what the backend settles after them (every
        array the layer holds, less those it settled itself)."""
        ...

    def reserve(self, capacity: int) -> None:
        """Make room for `capacity` slots (resident and stage together), keeping what is held."""
        ...

    def stage(self, slot: int, keys: A, values: A) -> None:
        """Write a forward's K/V `[B, H, n, D]` into stage slots `[slot, slot + n)`."""
        ...

    def read(self, stage_offset: int, end: int) -> tuple[A, A]:
        """Dense K/V `[B, H, end, D]` of slots `[0, end)`: resident slots before `stage_offset`, staged after (a lossy
        store appends a multi-query forward's own entries as computed)."""
        ...

    def read_parts(self, stage_offset: int, end: int) -> list[KeyPart[A]]:
        """What `read` returns, as consecutive parts: a store that holds resident entries compactly hands them over
        as they are held, for attention to read chunk by chunk."""
        ...

    def commit(self, plan: CommitPlan) -> None:
        """Make accepted staged entries resident as `plan` says; the rest of the stage is forgotten."""
        ...

    def gather(self, slots: np.ndarray) -> tuple[A, A]:
        """Dense K/V `[B, H, len(slots), D]` of resident `slots`."""
        ...

    def load(self, slots: np.ndarray, keys: A, values: A) -> None:
        """Hold `keys`/`values` `[B, H, len(slots), D]` as the resident entries of `slots`."""
        ...

    def load_from(self, source: LayerStore[A], source_slots: np.ndarray, slots: np.ndarray) -> None:
        """Hold the resident entries `source_slots` of `source` (a layer of another cache) as those of `slots`,
        copied in the form they are held when `source` is a store of this kind."""
        ...

    def park(self, slots: int) -> None:
        """The session stops generating for now: drop whatever only speeds up forwards, and the room beyond the
        first `slots` slots (every resident entry is in them and stays; the next forward grows the room again)."""
        ...

    def release(self) -> None:
        """Drop everything held."""
        ...


@runtime_checkable
class RestingStore(Protocol):
    """A store whose residents a generation holds in a form that is also a resident form (a packed store's lattice
    coordinates): between generations it may keep that form, trading bytes for the next generation's start and
    this one's end."""

    def rest(self, slots: int) -> bool:
        """As `park`, but the residents stay in the form the generation held them in; whether the store kept
        anything that `park` would have turned into another form."""
        ...


@runtime_checkable
class ReadOnceStage(Protocol):
    """A store whose stage of a block is read by nothing but that block's attention in its layer once the
    forward's one model call has passed it (a packed store's dense copies of a prefill chunk, kept beside the
    chunk's coding, which is all its commit needs)."""

    def stage_read(self) -> None:
        """The model call in flight, the stage's only one, has read this layer's stage: what only that read needed
        may go. A later forward that extends this stage then fails instead of reading what went."""
        ...


def joined_parts(ops: ArrayOps[A], parts: Sequence[KeyPart[A]]) -> tuple[A, A]:
    """Keys and values read in parts as one dense pair (a held part decoded; no copy for a single dense part)."""
    dense = [part if isinstance(part, tuple) else part.dense() for part in parts]
    if len(dense) == 1:
        return dense[0]
    return ops.concat([k for k, _ in dense]), ops.concat([v for _, v in dense])


LayerStoreFactory = Callable[[ArrayOps[A]], LayerStore[A]]
"""Builds the store of one layer over a backend's array operations."""


def start_stages(stores: Sequence[LayerStore[A]]) -> None:
    """Let every class of store among `stores` (a cache's layers) begin its forward's deferred work in one call."""
    for group in _by_class(stores):
        group[0].start_stages(group)


def finish_stages(stores: Sequence[LayerStore[A]]) -> None:
    """Let every class of store among `stores` (a cache's layers) finish its forwards' deferred work in one call."""
    for group in _by_class(stores):
        group[0].finish_stages(group)


def _by_class(stores: Sequence[LayerStore[A]]) -> list[list[LayerStore[A]]]:
    by_class: dict[type, list[LayerStore[A]]] = {}
    for store in stores:
        by_class.setdefault(type(store), []).append(store)
    return list(by_class.values())


class DenseLayerStore(Generic[A]):
    """Resident and staged K/V in one buffer per tensor, in the model's dtype or in `dtype` (K/V rounded to it as
    they are written): attention reads a view of it."""

    lossy = False

    def __init__(self, ops: ArrayOps[A], dtype: Any = None) -> None:
        self._ops = ops
        self._dtype = dtype
        self.read_past = 0  # slots past the buffers' end attention may read (masked): room for it (`alloc_pair`)
        self._keys: A | None = None
        self._values: A | None = None
        self._capacity = 0
        self.held = 0

    @classmethod
    def start_stages(cls, stores: Sequence[LayerStore[A]]) -> None:
        return None

    @classmethod
    def finish_stages(cls, stores: Sequence[LayerStore[A]]) -> None:
        return None

    @property
    def active(self) -> bool:
        return self._keys is not None

    @property
    def nbytes(self) -> int:
        if self._keys is None or self._values is None:
            return 0
        return self._ops.pair_nbytes(self._keys, self._values)

    def _slot_bytes(self) -> int:
        """Bytes of the buffers' slots, without room `alloc_pair` placed after them."""
        if self._keys is None or self._values is None:
            return 0
        return self._ops.nbytes(self._keys) + self._ops.nbytes(self._values)

    def working_nbytes(self, slots: int) -> int:
        if self._capacity <= slots:
            return self.nbytes - self._slot_bytes()
        return self.nbytes - self._slot_bytes() * slots // self._capacity

    def footprint(self) -> StoreFootprint:
        if self._keys is None or self._capacity == 0:
            return StoreFootprint(0, 0, 0)
        return StoreFootprint(0, self._slot_bytes() * self.held // self._capacity, 0)

    def arrays(self) -> list[A]:
        if self._keys is None or self._values is None:
            return []
        return [self._keys, self._values]

    def reserve(self, capacity: int) -> None:
        if capacity <= self._capacity:
            return
        if self._keys is not None and self._values is not None:
            self._keys, self._values = self._ops.grow_pair(self._keys, self._values, capacity, self.read_past)
        self._capacity = capacity

    def _buffers(self, keys: A, values: A) -> tuple[A, A]:
        """The buffers, allocated in the held dtype for K/V like `keys` and `values` on the first write."""
        if self._keys is None or self._values is None:
            held_keys, held_values = self._held(keys), self._held(values)
            self._keys, self._values = self._ops.alloc_pair(held_keys, held_values, self._capacity, self.read_past)
        return self._keys, self._values

    def _held(self, array: A) -> A:
        return array if self._dtype is None else self._ops.cast(array, self._dtype)

    def stage(self, slot: int, keys: A, values: A) -> None:
        key_buf, value_buf = self._buffers(keys, values)
        # the write rounds them to the buffers' dtype as `_held` would, without a cast copy first
        self._keys = self._ops.write(key_buf, slot, keys)
        self._values = self._ops.write(value_buf, slot, values)

    def read(self, stage_offset: int, end: int) -> tuple[A, A]:
        if self._keys is None or self._values is None:
            raise ValueError("the layer holds no K/V")
        return self._ops.head(self._keys, end), self._ops.head(self._values, end)

    def read_parts(self, stage_offset: int, end: int) -> list[KeyPart[A]]:
        return [self.read(stage_offset, end)]

    def commit(self, plan: CommitPlan) -> None:
        if self._keys is None or self._values is None:
            return
        if plan.slots is not None and plan.sources is not None and plan.slots.size:
            sources = plan.source_slots if plan.source_slots is not None else plan.sources + plan.stage_offset
            self._keys = self._ops.put(self._keys, plan.slots, self._ops.take(self._keys, sources))
            self._values = self._ops.put(self._values, plan.slots, self._ops.take(self._values, sources))
        self.held += plan.newly_held

    def gather(self, slots: np.ndarray) -> tuple[A, A]:
        if self._keys is None or self._values is None:
            raise ValueError("the layer holds no K/V")
        return self._ops.take(self._keys, slots), self._ops.take(self._values, slots)

    def load(self, slots: np.ndarray, keys: A, values: A) -> None:
        keys, values = self._held(keys), self._held(values)
        key_buf, value_buf = self._buffers(keys, values)
        self._keys = self._ops.put(key_buf, slots, keys)
        self._values = self._ops.put(value_buf, slots, values)

    def load_from(self, source: LayerStore[A], source_slots: np.ndarray, slots: np.ndarray) -> None:
        self.load(slots, *source.gather(source_slots))

    def park(self, slots: int) -> None:
        # One copy per generation, so that a parked session holds its resident entries and no room.
        if self._keys is None or self._values is None:
            return
        if self._capacity <= slots and self.nbytes == self._slot_bytes():
            return
        slots = min(slots, self._capacity)
        kept = np.arange(slots, dtype=np.int64)
        self._keys, self._values = self._ops.take(self._keys, kept), self._ops.take(self._values, kept)
        self._ops.settle([self._keys, self._values])  # the old buffers are freed now, not at the next forward
        self._capacity = slots

    def release(self) -> None:
        self._keys = self._values = None
        self._capacity = 0
        self.held = 0
