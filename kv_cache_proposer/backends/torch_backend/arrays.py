"""The session cache's array seam on PyTorch: K/V tensors `[B, H, slots, D]`, slot indices from host arrays."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kv_cache_proposer.cache.arrays import IndexedArrayOps

_ROOM_SHARE = 8  # `alloc_pair` places room for reads past the end where it adds at most an eighth of the bytes


class TorchArrayOps(IndexedArrayOps[torch.Tensor]):
    """`ArrayOps` over torch tensors; writes happen in place."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        # A commit moves every layer's K and V by the same two slot arrays: convert each once, not per tensor.
        self._recent: list[tuple[np.ndarray, torch.Tensor]] = []

    def _index(self, slots: np.ndarray) -> torch.Tensor:
        for array, index in self._recent:
            if array is slots:
                return index
        index = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self._device)
        self._recent = [(slots, index), *self._recent[:1]]
        return index

    def alloc(self, like: torch.Tensor, capacity: int) -> torch.Tensor:
        return torch.zeros(
            (like.shape[0], like.shape[1], capacity, like.shape[3]), dtype=like.dtype, device=like.device
        )

    def grow(self, buffer: torch.Tensor, capacity: int) -> torch.Tensor:
        grown = self.alloc(buffer, capacity)
        grown[:, :, : buffer.shape[2]] = buffer
        return grown

    def alloc_pair(
        self, keys: torch.Tensor, values: torch.Tensor, capacity: int, room: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys, then values, then `room` slots of one head in one zeroed allocation (where both have one shape,
        dtype and device and the room adds at most `1 / _ROOM_SHARE` of their bytes): a read of up to `room` slots
        past the end of a head lands in the next head's slots, the values' first head or the room."""
        batch, heads, _, dim = keys.shape
        paired = keys.shape == values.shape and keys.dtype == values.dtype and keys.device == values.device
        if not room or not paired or room * _ROOM_SHARE > 2 * batch * heads * capacity:
            return self.alloc(keys, capacity), self.alloc(values, capacity)
        size = batch * heads * capacity * dim
        storage = torch.zeros(2 * size + room * dim, dtype=keys.dtype, device=keys.device)
        shape = (batch, heads, capacity, dim)
        return storage[:size].view(shape), storage[size : 2 * size].view(shape)

    def grow_pair(
        self, keys: torch.Tensor, values: torch.Tensor, capacity: int, room: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        grown = self.alloc_pair(keys, values, capacity, room)
        for new, old in zip(grown, (keys, values), strict=True):
            new[:, :, : old.shape[2]] = old
        return grown

    def pair_nbytes(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        storage = keys.untyped_storage()
        if storage.data_ptr() == values.untyped_storage().data_ptr():
            return int(storage.nbytes())
        return self.nbytes(keys) + self.nbytes(values)

    # Narrowed views: what indexing with slices gives, for less Python per call (a batched step stages every row's
    # K/V in every layer).
    def write(self, buffer: torch.Tensor, start: int, values: torch.Tensor) -> torch.Tensor:
        buffer.narrow(2, start, int(values.shape[2])).copy_(values)
        return buffer

    def head(self, buffer: torch.Tensor, end: int) -> torch.Tensor:
        return buffer.narrow(2, 0, end) if 0 <= end <= buffer.shape[2] else buffer[:, :, :end]

    def span(self, buffer: torch.Tensor, start: int, end: int) -> torch.Tensor:
        fits = 0 <= start <= end <= buffer.shape[2]
        return buffer.narrow(2, start, end - start) if fits else buffer[:, :, start:end]

    def take(self, buffer: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
        return buffer.index_select(2, self._index(slots))

    def put(self, buffer: torch.Tensor, slots: np.ndarray, values: torch.Tensor) -> torch.Tensor:
        return buffer.index_copy_(2, self._index(slots), values)

    def concat(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(parts), dim=2)

    def cast(self, array: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return array.to(dtype)

    def nbytes(self, array: torch.Tensor) -> int:
        return array.numel() * array.element_size()

    def settle(self, arrays: Sequence[torch.Tensor]) -> None:
        return None

    def to_host(self, array: torch.Tensor) -> np.ndarray:
        return array.detach().float().cpu().numpy()

    def from_host(self, array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=like.device, dtype=like.dtype)
