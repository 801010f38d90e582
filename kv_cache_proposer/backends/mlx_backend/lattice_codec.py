"""KakeyaLattice on MLX: the reference codec's math (Sylvester Hadamard rotation, per-vector fp16 scale,
Conway-Sloane closest point of D4 / E8, clamp) ported to `mlx.core` step by step, and its one-scale variant."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import mlx.core as mx
import numpy as np

from kv_cache_proposer.cache.protocol import HeldKeys
from kv_cache_proposer.compression.codec import CodedBlock, LatticeCoding, StagedCoding, split_stacked
from kv_cache_proposer.compression.lattice import LatticeSpec


def _hadamard(dim: int) -> mx.array:
    """Sylvester Hadamard H_D / sqrt(D), built like the reference (float32, self-inverse)."""
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < dim:
        h = np.block([[h, h], [h, -h]])
    return mx.array(h / np.float32(math.sqrt(dim)))


def _closest_even_sum(y: mx.array) -> mx.array:
    """Closest point of D_n (integer points with even sum) to each block `y` `[..., n]`."""
    f = mx.round(y)
    even = (f.sum(axis=-1).astype(mx.int64) % 2) == 0  # [...]
    diff = y - f
    idx = mx.argmax(mx.abs(diff), axis=-1, keepdims=True)  # [..., 1]
    step = mx.where(mx.take_along_axis(diff, idx, axis=-1) >= 0, 1.0, -1.0)  # [..., 1]
    flip = (mx.arange(y.shape[-1]) == idx).astype(y.dtype) * step
    return mx.where(even[..., None], f, f + flip)


def _closest_e8(y: mx.array) -> mx.array:
    """E8 = D8 ∪ (D8 + ½): the closer of the two cosets' closest points."""
    a = _closest_even_sum(y)
    b = _closest_even_sum(y - 0.5) + 0.5
    da = ((y - a) ** 2).sum(axis=-1, keepdims=True)
    db = ((y - b) ** 2).sum(axis=-1, keepdims=True)
    return mx.where(da <= db, a, b)


class MlxLatticeCodec:
    """`LatticeCodec` over mlx arrays."""

    def __init__(self, spec: LatticeSpec) -> None:
        self.spec = spec
        self._hadamard = _hadamard(spec.head_dim)
        self._compiled: dict[mx.Dtype, Callable[..., tuple[mx.array, ...]]] = {}

    def _code(self, vectors: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Doubled lattice coordinates `[N, D]` int16, norms and qmax `[N, 1]` float16 of `vectors` `[..., D]`."""
        spec = self.spec
        flat = vectors.reshape(-1, spec.head_dim).astype(mx.float32)  # [N, D]
        n = flat.shape[0]
        eps = float(np.finfo(np.float32).eps)
        if spec.one_scale:  # rotated as they are: qmax alone scales them, clamped to fp16's largest finite value
            norms = mx.ones((n, 1), dtype=mx.float32)
            rotated = flat @ self._hadamard
            largest = mx.clip(mx.abs(rotated).max(axis=1, keepdims=True), eps, 65504.0)
        else:
            norms = mx.maximum(mx.sqrt((flat * flat).sum(axis=1, keepdims=True)), eps)  # [N, 1]
            rotated = (flat / norms) @ self._hadamard
            largest = mx.maximum(mx.abs(rotated).max(axis=1, keepdims=True), eps)
        qmax_f16 = largest.astype(mx.float16)
        scale = qmax_f16.astype(mx.float32) / float(spec.q_range)
        blocks = (rotated / scale).reshape(n, spec.blocks, spec.block_dim)
        closest = _closest_even_sum(blocks) if spec.kind == "d4" else _closest_e8(blocks)
        lattice = mx.clip(closest, -spec.q_range, spec.q_range)
        doubled = (lattice * 2).reshape(n, spec.head_dim).astype(mx.int16)
        return doubled, norms.astype(mx.float16), qmax_f16

    def _decoded(self, doubled: mx.array, norms: mx.array, qmax: mx.array) -> mx.array:
        """Float32 vectors `[N, D]` of doubled coordinates `[N, D]` and fp16 norms / qmax (N values each)."""
        spec = self.spec
        n = doubled.shape[0]
        lattice = doubled.astype(mx.float32) / 2
        scale = qmax.astype(mx.float32).reshape(n, 1, 1) / float(spec.q_range)
        rotated = (lattice.reshape(n, spec.blocks, spec.block_dim) * scale).reshape(n, spec.head_dim)
        return (rotated @ self._hadamard) * norms.astype(mx.float32).reshape(n, 1)

    def encode(self, vectors: mx.array) -> LatticeCoding:
        doubled, norms, qmax = self._code(vectors)
        n = doubled.shape[0]
        return LatticeCoding(
            doubled=np.array(doubled), norms=np.array(norms.reshape(n)), qmax=np.array(qmax.reshape(n))
        )

    def decode(self, coding: LatticeCoding, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
        decoded = self._decoded(mx.array(coding.doubled), mx.array(coding.norms), mx.array(coding.qmax))
        return decoded.reshape(shape).astype(dtype)

    def code_blocks(
        self, blocks: Sequence[tuple[mx.array, mx.array]], dtype: mx.Dtype
    ) -> list[tuple[mx.array, mx.array, StagedCoding[mx.array]]]:
        compiled = self._compiled.get(dtype)
        if compiled is None:
            # One fused graph per dtype (mx.compile traces again for each new input shape): a decode step codes a
            # few vectors per layer, where launching some forty small kernels one by one costs three times more.
            compiled = self._compiled[dtype] = mx.compile(partial(self._code_stacked, dtype=dtype))
        both = mx.concatenate([part for pair in blocks for part in pair], axis=0)  # [R, H, n, D]
        decoded, doubled, norms, qmax = compiled(both)
        return split_stacked(blocks, decoded, StagedCoding(doubled, norms, qmax))

    def start_code_blocks(
        self, blocks: Sequence[tuple[mx.array, mx.array]], dtype: mx.Dtype
    ) -> Callable[[], list[CodedBlock[mx.array]]]:
        coded = self.code_blocks(blocks, dtype)  # a lazy graph: MLX computes it when it is first evaluated
        return lambda: coded

    def _code_stacked(self, both: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Stacked K/V rows `[R, H, n, D]` in one pass: decoded (in `dtype`), doubled coordinates, norms, qmax."""
        rows, heads, count, dim = both.shape
        doubled, norms, qmax = self._code(both)
        decoded = self._decoded(doubled, norms, qmax).astype(dtype).reshape(rows, heads, count, dim)
        return (
            decoded,
            doubled.reshape(rows, heads, count, dim),
            norms.reshape(rows, heads, count, 1),
            qmax.reshape(rows, heads, count, 1),
        )

    def to_host(self, coding: StagedCoding[mx.array]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return np.array(coding.doubled), np.array(coding.norms.squeeze(-1)), np.array(coding.qmax.squeeze(-1))

    @property
    def reads_held(self) -> bool:
        return False  # mlx-lm's attention reads dense K/V: a generating session keeps its entries decoded

    def held_keys(self, coding: StagedCoding[mx.array], dtype: mx.Dtype) -> HeldKeys[mx.array]:
        raise NotImplementedError("attention on MLX reads decoded K/V, not held codings (reads_held is False)")

    def coordinate_dtype(self) -> mx.Dtype:
        return mx.int16
