"""The array seam of a session cache: the few array operations a backend provides.

Everything else a session cache does (slots, positions, staging, commit, eviction, invariants, byte accounting)
is written once over this interface. Arrays of K/V are laid out `[batch, kv_heads, slots, head_dim]`; slot
indices are host integer arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

A = TypeVar("A")


class ArrayOps(Protocol[A]):
    """Array operations on one backend's K/V arrays, along the slot axis (axis 2)."""

    def alloc(self, like: A, capacity: int) -> A:
        """Zeros `[B, H, capacity, D]` with the batch, heads, head size, dtype and device of `like`."""
        ...

    def grow(self, buffer: A, capacity: int) -> A:
        """`buffer` extended with zero slots to `capacity`, its contents kept."""
        ...

    def alloc_pair(self, keys: A, values: A, capacity: int, room: int = 0) -> tuple[A, A]:
        """Zero buffers for one layer's keys and values, each as `alloc`. `room`: how many slots past a buffer's
        end attention may read (values it masks out); a backend may then place both buffers and zeroed room after
        them in one allocation, so that such a read stays in it (`pair_nbytes` counts the room)."""
        ...

    def grow_pair(self, keys: A, values: A, capacity: int, room: int = 0) -> tuple[A, A]:
        """`keys` and `values` extended with zero slots to `capacity`, their contents kept (as `alloc_pair`)."""
        ...

    def pair_nbytes(self, keys: A, values: A) -> int:
        """Bytes one layer's keys and values hold, with any room `alloc_pair` placed after them."""
        ...

    def write(self, buffer: A, start: int, values: A) -> A:
        """Write `values` `[B, H, n, D]` into slots `[start, start + n)` of `buffer`, rounded to its dtype as a cast
        to it would round them; returns the buffer."""
        ...

    def head(self, buffer: A, end: int) -> A:
        """Slots `[0, end)` of `buffer` (a view where the backend has views)."""
        ...

    def span(self, buffer: A, start: int, end: int) -> A:
        """Slots `[start, end)` of `buffer` (a view where the backend has views)."""
        ...

    def take(self, buffer: A, slots: np.ndarray) -> A:
        """The entries of `slots`, in that order."""
        ...

    def put(self, buffer: A, slots: np.ndarray, values: A) -> A:
        """Write `values` `[B, H, len(slots), D]` into `slots` of `buffer`; returns the buffer."""
        ...

    def concat(self, parts: Sequence[A]) -> A:
        """The parts joined along the slot axis."""
        ...

    def cast(self, array: A, dtype: Any) -> A:
        """`array` converted to `dtype` (a dtype of this backend)."""
        ...

    def dtype(self, array: A) -> Any:
        """The backend dtype of `array`."""
        ...

    def length(self, array: A) -> int:
        """Number of slots (entries along the slot axis) of `array`."""
        ...

    def nbytes(self, array: A) -> int:
        """Bytes `array` holds."""
        ...

    def settle(self, arrays: Sequence[A]) -> None:
        """Finish any pending computation of `arrays`, so no lazy graph outlives the call that made it."""
        ...

    def to_host(self, array: A) -> np.ndarray:
        """A float32 host copy of `array`."""
        ...

    def from_host(self, array: np.ndarray, like: A) -> A:
        """`array` as a backend array with the dtype and device of `like`."""
        ...


class IndexedArrayOps(Generic[A]):
    """The part of `ArrayOps` every backend writes alike, for arrays that index and slice like numpy's."""

    def alloc_pair(self, keys: A, values: A, capacity: int, room: int = 0) -> tuple[A, A]:
        ops: Any = self
        return ops.alloc(keys, capacity), ops.alloc(values, capacity)

    def grow_pair(self, keys: A, values: A, capacity: int, room: int = 0) -> tuple[A, A]:
        ops: Any = self
        return ops.grow(keys, capacity), ops.grow(values, capacity)

    def pair_nbytes(self, keys: A, values: A) -> int:
        ops: Any = self
        return int(ops.nbytes(keys) + ops.nbytes(values))

    def write(self, buffer: A, start: int, values: A) -> A:
        target: Any = buffer
        target[:, :, start : start + self.length(values)] = values
        return buffer

    def head(self, buffer: A, end: int) -> A:
        source: Any = buffer
        return source[:, :, :end]

    def span(self, buffer: A, start: int, end: int) -> A:
        source: Any = buffer
        return source[:, :, start:end]

    def length(self, array: A) -> int:
        source: Any = array
        return int(source.shape[2])

    def dtype(self, array: A) -> Any:
        source: Any = array
        return source.dtype
