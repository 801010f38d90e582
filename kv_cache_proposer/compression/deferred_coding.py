"""A one-token forward's K/V, coded late: one pass of the codec for the pending entry of every layer of a cache,
begun when the forward's last layer has staged (it may run beside the rest of the forward) and taken before the
commit or the next forward."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol

from kv_cache_proposer.cache.arrays import A
from kv_cache_proposer.compression.codec import CodedBlock, LatticeCodec


@dataclass(slots=True)
class PendingEntry(Generic[A]):
    """A one-token forward's entry at a stage slot, staged as computed and not coded yet."""

    slot: int
    keys: A
    values: A


@dataclass(slots=True)
class BegunCoding(Generic[A]):
    """A codec pass begun for a pending entry."""

    entry: PendingEntry[A]  # the entry the pass codes
    result: Callable[[], list[CodedBlock[A]]]  # the pass's result, when it is ready
    index: int  # the entry's block in the pass


class DeferredCoder(Protocol[A]):
    """A layer store whose one-token forwards' entries are coded late (`PackedLayerStore`)."""

    @property
    def pending(self) -> PendingEntry[A] | None:
        """The entry waiting for its coding, if any."""
        ...

    def coding_key(self) -> tuple[Any, ...]:
        """What one codec pass can take together: lattice, dtype and K/V shape."""
        ...

    def codec(self) -> tuple[LatticeCodec[A], Any]:
        """The layer's codec and the model's dtype its decoded K/V take."""
        ...

    def begin(self, result: Callable[[], list[CodedBlock[A]]], index: int) -> None:
        """A pass coding the pending entry has begun: its block `index` of `result()`."""
        ...

    def begun(self) -> bool:
        """Whether a pass coding the pending entry has begun."""
        ...

    def take_coding(self, block: CodedBlock[A] | None = None) -> None:
        """Stage the pending entry's coding: `block`, or what the pass begun for it gives."""
        ...


def start_codings(stores: Sequence[DeferredCoder[A]]) -> None:
    """Begin coding the pending entries of `stores` whose coding has not begun, one codec pass per group (nothing
    changes what a layer holds until `finish_codings`)."""
    waiting = [store for store in stores if store.pending is not None and not store.begun()]
    for group in _groups(waiting):
        codec, dtype = group[0].codec()
        result = codec.start_code_blocks([_block(store) for store in group], dtype)
        for index, store in enumerate(group):
            store.begin(result, index)


def finish_codings(stores: Sequence[DeferredCoder[A]]) -> None:
    """Stage the codings of every pending entry of `stores`: those begun by `start_codings`, the others in one
    codec pass per group."""
    waiting = [store for store in stores if store.pending is not None]
    for store in [store for store in waiting if store.begun()]:
        store.take_coding()
    for group in _groups([store for store in waiting if store.pending is not None]):
        codec, dtype = group[0].codec()
        for store, block in zip(group, codec.code_blocks([_block(store) for store in group], dtype), strict=True):
            store.take_coding(block)


def _block(store: DeferredCoder[A]) -> tuple[A, A]:
    entry = store.pending
    assert entry is not None
    return entry.keys, entry.values


def _groups(stores: list[DeferredCoder[A]]) -> list[list[DeferredCoder[A]]]:
    groups: dict[tuple[Any, ...], list[DeferredCoder[A]]] = {}
    for store in stores:
        groups.setdefault(store.coding_key(), []).append(store)
    return list(groups.values())
