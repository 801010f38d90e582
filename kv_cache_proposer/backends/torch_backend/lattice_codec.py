"""KakeyaLattice on PyTorch: the `kakeyalattice` package's `roundtrip()` split into its encode and decode halves,
so the lattice coordinates can be stored.

The steps are the package's, op for op and in its dtypes (its closest-point search is Conway-Sloane's, written out
here without the early return it takes when every block already has an even sum, which changes no output), so the
decoded vectors are the package's `roundtrip()` output bit for bit. They are compiled with TorchScript: a decode
step codes a few vectors per layer (or one per layer, for every layer at once), where the time goes to
dispatching some forty small ops from Python, and the interpreter halves that.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np
import torch
from kakeyalattice import V14KakeyaZamirLatticeGPU, V15KakeyaZamirE8GPU

from kv_cache_proposer.compression.codec import LatticeCoding, StagedCoding, split_stacked
from kv_cache_proposer.compression.lattice import LatticeSpec


def _closest_even_sum(y: torch.Tensor) -> torch.Tensor:
    """Closest point of D_n (integer points with even sum) to each block `y` `[..., n]`: the package's D4 / D8 search
    (round; where the sum is odd, move the coordinate rounded furthest one step towards `y`, the first on ties).

    Written in few ops, since a decode step codes a vector or two per layer and pays per op: the sum's remainder
    is the step's size (0 or 1, exact for the small integer sum), and its sign is that of the rounding error
    (`copysign`: the error is never −0, as `y − round(y)` is +0 when they are equal)."""
    f = torch.round(y)
    diff = y - f
    idx = diff.abs().argmax(dim=-1, keepdim=True)  # [..., 1]
    step = torch.copysign(torch.remainder(f.sum(dim=-1, keepdim=True), 2.0), diff.gather(-1, idx))
    return f.scatter_add_(-1, idx, step)


def _code(
    vectors: torch.Tensor, hadamard: torch.Tensor, q_range: int, block_dim: int, e8: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lattice coordinates `[N, D/b, b]` float32, norms and qmax `[N, 1]` float16, and the scale `[N, 1, 1]`
    float32 (qmax as stored, over Q) of `vectors` `[..., D]`."""
    dim = vectors.shape[-1]
    flat = vectors.reshape(-1, dim).to(torch.float32)  # [N, D]
    n = flat.shape[0]
    eps = 1.1920928955078125e-07  # float32 eps
    norms = torch.linalg.vector_norm(flat, 2.0, [1], True).clamp(min=eps)  # [N, 1]
    rotated = (flat / norms) @ hadamard
    qmax = rotated.abs().amax(dim=1, keepdim=True).clamp(min=eps).to(torch.float16)  # [N, 1]
    scale = (qmax.to(torch.float32) / float(q_range)).unsqueeze(-1)  # [N, 1, 1]
    blocks = rotated.reshape(n, dim // block_dim, block_dim) / scale
    if e8:  # E8 = D8 ∪ (D8 + ½): the closer of the two cosets' points
        a = _closest_even_sum(blocks)
        half = torch.full_like(blocks[..., :1], 0.5)
        b = _closest_even_sum(blocks - half) + half
        da = ((blocks - a) ** 2).sum(dim=-1, keepdim=True)
        db = ((blocks - b) ** 2).sum(dim=-1, keepdim=True)
        lattice = torch.where(da <= db, a, b)
    else:
        lattice = _closest_even_sum(blocks)
    return lattice.clamp(-q_range, q_range), norms.to(torch.float16), qmax, scale


def _decoded(lattice: torch.Tensor, scale: torch.Tensor, norms: torch.Tensor, hadamard: torch.Tensor) -> torch.Tensor:
    """Float32 vectors `[N, D]` of lattice coordinates `[N, D/b, b]`, scales `[N, 1, 1]` float32 (stored qmax over
    Q) and stored norms `[N, 1]` (fp16 values)."""
    rotated = (lattice * scale).reshape(lattice.shape[0], -1)
    return (rotated @ hadamard) * norms.to(torch.float32)


def _code_stacked(
    both: torch.Tensor, hadamard: torch.Tensor, q_range: int, block_dim: int, e8: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V vectors `[R, H, n, D]` (blocks' K and V rows stacked) coded in one pass: decoded `[R, H, n, D]` float32,
    doubled coordinates `[R, H, n, D]` int16, norms and qmax `[R, H, n, 1]` float16."""
    shape = both.shape
    lattice, norms, qmax, scale = _code(both, hadamard, q_range, block_dim, e8)
    decoded = _decoded(lattice, scale, norms, hadamard).reshape(shape)
    doubled = (lattice * 2).to(torch.int16).reshape(shape)
    scalar_shape = [shape[0], shape[1], shape[2], 1]
    return decoded, doubled, norms.reshape(scalar_shape), qmax.reshape(scalar_shape)


@cache
def _compiled() -> tuple[Any, Any, Any]:
    """The three steps compiled once per process (`torch.jit.script` warns that it is deprecated; it is still the
    way to run a small op graph without Python between the ops, which `torch.compile` does only with a compiler
    toolchain and a long first call)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(_code), torch.jit.script(_decoded), torch.jit.script(_code_stacked)


class TorchLatticeCodec:
    """`LatticeCodec` over torch tensors; every step is the reference `roundtrip()`'s, in its order and dtypes."""

    def __init__(self, spec: LatticeSpec, device: torch.device) -> None:
        self.spec = spec
        self._device = device
        codec_class = V14KakeyaZamirLatticeGPU if spec.kind == "d4" else V15KakeyaZamirE8GPU
        # The package runs on any torch device; "cuda" is only its default.
        self.reference = codec_class(D=spec.head_dim, q_range=spec.q_range, device=str(device))
        self._hadamard = self.reference.H  # [D, D], self-inverse
        self._code, self._decoded, self._code_stacked = _compiled()

    def encode(self, vectors: torch.Tensor) -> LatticeCoding:
        spec = self.spec
        lattice, norms, qmax, _ = self._code(vectors, self._hadamard, spec.q_range, spec.block_dim, spec.kind == "e8")
        n = lattice.shape[0]
        doubled = (lattice * 2).reshape(n, spec.head_dim).to(torch.int16)
        return LatticeCoding(
            doubled=doubled.cpu().numpy(),
            norms=norms.reshape(n).cpu().numpy(),
            qmax=qmax.reshape(n).cpu().numpy(),
        )

    def decode(self, coding: LatticeCoding, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        spec = self.spec
        n = coding.count
        device = self._device
        lattice = torch.from_numpy(coding.doubled).to(device).to(torch.float32) / 2  # exact: halves of integers
        norms = torch.from_numpy(coding.norms).to(device).reshape(n, 1)
        scale = torch.from_numpy(coding.qmax).to(device).to(torch.float32).reshape(n, 1, 1) / float(spec.q_range)
        blocks = lattice.reshape(n, spec.blocks, spec.block_dim)
        return self._decoded(blocks, scale, norms, self._hadamard).reshape(shape).to(dtype)

    def code_blocks(
        self, blocks: Sequence[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor, StagedCoding[torch.Tensor]]]:
        spec = self.spec
        both = torch.cat([part for pair in blocks for part in pair], dim=0)  # [R, H, n, D]: K, V of each block
        decoded, doubled, norms, qmax = self._code_stacked(
            both, self._hadamard, spec.q_range, spec.block_dim, spec.kind == "e8"
        )
        return split_stacked(blocks, decoded.to(dtype), StagedCoding(doubled, norms, qmax))

    def to_host(self, coding: StagedCoding[torch.Tensor]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (
            coding.doubled.cpu().numpy(),
            coding.norms.squeeze(-1).cpu().numpy(),
            coding.qmax.squeeze(-1).cpu().numpy(),
        )


def coding_matches(codec: TorchLatticeCodec, vectors: torch.Tensor) -> bool:
    """Whether decoding the coding of `vectors` gives exactly the reference `roundtrip()` output."""
    flat = vectors.reshape(-1, codec.spec.head_dim)
    decoded = codec.decode(codec.encode(flat), tuple(flat.shape), torch.float32)
    reference = codec.reference.roundtrip(flat)
    return bool(np.array_equal(decoded.cpu().numpy(), reference.cpu().numpy()))
