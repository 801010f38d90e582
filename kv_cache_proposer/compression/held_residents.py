"""A generating packed layer's resident entries as lattice coordinates on the backend: the form attention reads
without decoding (`LatticeCodec.held_keys`), at about a quarter of the dense K/V's bytes (int8 doubled coordinates
for `q_range` ≤ 63, plus fp16 norms and scales), where a decoded working copy would hold them all dense."""

from __future__ import annotations

from typing import Any, Generic

import numpy as np

from kv_cache_proposer.cache.arrays import A, ArrayOps
from kv_cache_proposer.cache.protocol import HeldKeys
from kv_cache_proposer.compression.codec import LatticeCodec, LatticeCoding, StagedCoding


class HeldResidents(Generic[A]):
    """Resident codings by slot, laid out as `StagedCoding` (`[2·B, H, slots, D]`: K rows, then V rows)."""

    def __init__(self, ops: ArrayOps[A], codec: LatticeCodec[A], sample: StagedCoding[A], dtype: Any) -> None:
        """`sample`: any coding on this backend (it shows the arrays' dtypes and device); `dtype`: the model's."""
        self._ops = ops
        self._codec = codec
        self._dtype = dtype
        self._like = StagedCoding(ops.cast(sample.doubled, codec.coordinate_dtype()), sample.norms, sample.qmax)
        self._arrays: StagedCoding[A] | None = None
        self._capacity = 0

    @property
    def nbytes(self) -> int:
        return 0 if self._arrays is None else sum(self._ops.nbytes(array) for array in self._arrays.arrays())

    def arrays(self) -> list[A]:
        return [] if self._arrays is None else self._arrays.arrays()

    def reserve(self, capacity: int) -> None:
        if capacity <= self._capacity:
            return
        if self._arrays is not None:
            self._arrays = StagedCoding(*(self._ops.grow(array, capacity) for array in self._arrays.arrays()))
        self._capacity = capacity

    def put(self, slots: np.ndarray, coding: StagedCoding[A]) -> None:
        """Hold `coding` (of `len(slots)` entries) at `slots`."""
        held = self._held()
        doubled = self._ops.cast(coding.doubled, self._ops.dtype(held.doubled))
        parts = zip(held.arrays(), (doubled, coding.norms, coding.qmax), strict=True)
        self._arrays = StagedCoding(*(self._ops.put(array, slots, part) for array, part in parts))

    def put_host(self, slots: np.ndarray, keys: LatticeCoding, values: LatticeCoding, batch: int) -> None:
        """Hold host codings of K and V (`PackedCodes.read` order: row-major over `B·H` rows) at `slots`."""
        count = slots.size
        if not count:
            return
        pairs = zip(_by_row(keys, batch, count), _by_row(values, batch, count), strict=True)
        stacked = [np.concatenate([k, v]) for k, v in pairs]
        parts = zip(stacked, self._like.arrays(), strict=True)
        coding = StagedCoding(*(self._ops.from_host(array, like) for array, like in parts))
        self.put(slots, coding)

    def occupied(self) -> np.ndarray:
        """The slots holding an entry: a written entry's scale is never 0 (see `PackedCodes.occupied`)."""
        if self._arrays is None:
            return np.zeros(0, dtype=np.int64)
        qmax = self._ops.to_host(self._ops.head(self._arrays.qmax, self._capacity))  # [2·B, H, slots, 1]
        return np.flatnonzero(qmax[0, 0, :, 0] > 0)

    def take(self, slots: np.ndarray) -> StagedCoding[A]:
        return StagedCoding(*(self._ops.take(array, slots) for array in self._held().arrays()))

    def keys(self, end: int) -> HeldKeys[A]:
        """Slots `[0, end)` as attention reads them."""
        head = StagedCoding(*(self._ops.head(array, end) for array in self._held().arrays()))
        return self._codec.held_keys(head, self._dtype)

    def trim(self, slots: int) -> None:
        """Drop the room beyond the first `slots` slots (every entry is in them)."""
        if self._arrays is None or self._capacity <= slots:
            return
        kept = np.arange(slots, dtype=np.int64)
        self._arrays = StagedCoding(*(self._ops.take(array, kept) for array in self._arrays.arrays()))
        self._ops.settle(self._arrays.arrays())  # the old buffers are freed now
        self._capacity = slots

    def release(self) -> None:
        self._arrays = None
        self._capacity = 0

    def _held(self) -> StagedCoding[A]:
        if self._arrays is None:
            self._arrays = StagedCoding(*(self._ops.alloc(like, self._capacity) for like in self._like.arrays()))
        return self._arrays


def _by_row(coding: LatticeCoding, batch: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A host coding of `rows · count` vectors as `[B, H, count, D]` doubled and `[B, H, count, 1]` norms, qmax."""
    doubled = coding.doubled.reshape(batch, -1, count, coding.doubled.shape[-1])
    heads = doubled.shape[1]
    return doubled, coding.norms.reshape(batch, heads, count, 1), coding.qmax.reshape(batch, heads, count, 1)
