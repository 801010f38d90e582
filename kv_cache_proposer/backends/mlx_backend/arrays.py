"""The session cache's array seam on MLX: K/V arrays `[B, H, slots, D]`, slot indices from host arrays."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from kv_cache_proposer.cache.arrays import IndexedArrayOps


class MlxArrayOps(IndexedArrayOps[mx.array]):
    """`ArrayOps` over mlx arrays. Writes update the array object (MLX's in-place indexing)."""

    def alloc(self, like: mx.array, capacity: int) -> mx.array:
        return mx.zeros((like.shape[0], like.shape[1], capacity, like.shape[3]), dtype=like.dtype)

    def grow(self, buffer: mx.array, capacity: int) -> mx.array:
        extra = mx.zeros((*buffer.shape[:2], capacity - buffer.shape[2], buffer.shape[3]), dtype=buffer.dtype)
        return mx.concatenate([buffer, extra], axis=2)

    def take(self, buffer: mx.array, slots: np.ndarray) -> mx.array:
        return buffer[:, :, mx.array(slots)]

    def put(self, buffer: mx.array, slots: np.ndarray, values: mx.array) -> mx.array:
        buffer[:, :, mx.array(slots)] = values
        return buffer

    def concat(self, parts: Sequence[mx.array]) -> mx.array:
        return mx.concatenate(list(parts), axis=2)

    def cast(self, array: mx.array, dtype: mx.Dtype) -> mx.array:
        return array.astype(dtype)

    def nbytes(self, array: mx.array) -> int:
        return int(array.nbytes)

    def settle(self, arrays: Sequence[mx.array]) -> None:
        mx.eval(list(arrays))

    def to_host(self, array: mx.array) -> np.ndarray:
        return np.asarray(array.astype(mx.float32))

    def from_host(self, array: np.ndarray, like: mx.array) -> mx.array:
        return mx.array(array).astype(like.dtype)
