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
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import numpy as np
import torch
from kakeyalattice import V14KakeyaZamirLatticeGPU, V15KakeyaZamirE8GPU

from kv_cache_proposer.backends.torch_backend.held_attention import TorchHeldKeys
from kv_cache_proposer.compression.codec import CodedBlock, LatticeCoding, StagedCoding
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
    vectors: torch.Tensor, hadamard: torch.Tensor, q_range: int, block_dim: int, e8: bool, one_scale: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lattice coordinates float32 (shaped as `vectors` `[..., D]`), norms and qmax `[..., 1]` float16, and the
    scale `[..., 1]` float32 (qmax as stored, over Q) of `vectors`. Every value meets the ops and operands it meets
    in the reference, whatever the leading axes (K/V `[B, H, n, D]` are coded as they come).

    `one_scale`: the vectors are rotated as they are, not normalised first, so qmax alone scales them (clamped to
    fp16's largest finite value) and the norms are 1.0 (decoding multiplies by them exactly)."""
    if vectors.dtype != torch.float32:
        vectors = vectors.to(torch.float32)
    shape = vectors.shape
    dim = shape[-1]
    eps = 1.1920928955078125e-07  # float32 eps
    if one_scale:
        norms = torch.ones_like(vectors[..., :1])
        rotated = vectors @ hadamard
        largest = rotated.abs().amax(dim=-1, keepdim=True).clamp(min=eps, max=65504.0)
    else:
        norms = torch.linalg.vector_norm(vectors, 2.0, [-1], True).clamp(min=eps)
        rotated = (vectors / norms) @ hadamard
        largest = rotated.abs().amax(dim=-1, keepdim=True).clamp(min=eps)
    qmax = largest.to(torch.float16)
    scale = qmax.to(torch.float32) / float(q_range)
    blocks_shape = list(shape[:-1]) + [dim // block_dim, block_dim]  # noqa: RUF005 (TorchScript has no list unpacking)
    blocks = (rotated / scale).reshape(blocks_shape)
    if e8:  # E8 = D8 ∪ (D8 + ½): the closer of the two cosets' points
        a = _closest_even_sum(blocks)
        half = torch.full_like(blocks[..., :1], 0.5)
        b = _closest_even_sum(blocks - half) + half
        da = ((blocks - a) ** 2).sum(dim=-1, keepdim=True)
        db = ((blocks - b) ** 2).sum(dim=-1, keepdim=True)
        lattice = torch.where(da <= db, a, b)
    else:
        lattice = _closest_even_sum(blocks)
    return lattice.clamp(-q_range, q_range).reshape(shape), norms.to(torch.float16), qmax, scale


def _decoded(lattice: torch.Tensor, scale: torch.Tensor, norms: torch.Tensor, hadamard: torch.Tensor) -> torch.Tensor:
    """Float32 vectors `[..., D]` of lattice coordinates `[..., D]`, scales `[..., 1]` float32 (stored qmax over Q)
    and stored norms `[..., 1]` (fp16 values)."""
    return ((lattice * scale) @ hadamard) * norms.to(torch.float32)


def _code_blocks(
    parts: list[torch.Tensor],
    hadamard: torch.Tensor,
    q_range: int,
    block_dim: int,
    e8: bool,
    one_scale: bool,
    dtype: torch.dtype,
) -> list[list[torch.Tensor]]:
    """`code_blocks` in one compiled pass. `parts` holds each block's K `[B, H, n, D]` then its V, every block of
    the same `B`; the result holds the decoded K and V of every block, in that order and in `dtype`, then per block
    the doubled coordinates `[2·B, H, n, D]` int16, then the norms and then the qmax `[2·B, H, n, 1]` float16.
    A decode step pays for each op it dispatches, so the stacking and splitting are done here, one op each."""
    batch = parts[0].shape[0]
    for part in parts:
        if part.shape[0] != batch:
            raise ValueError("every block coded together must have the same batch size")
    lattice, norms, qmax, scale = _code(torch.cat(parts, 0), hadamard, q_range, block_dim, e8, one_scale)
    decoded = _decoded(lattice, scale, norms, hadamard)
    if decoded.dtype != dtype:
        decoded = decoded.to(dtype)
    doubled = (lattice * 2).to(torch.int16)
    return [
        list(decoded.split(batch)),
        list(doubled.split(2 * batch)),
        list(norms.split(2 * batch)),
        list(qmax.split(2 * batch)),
    ]


@cache
def _compiled() -> tuple[Any, Any, Any]:
    """The three steps compiled once per process (`torch.jit.script` warns that it is deprecated; it is still the
    way to run a small op graph without Python between the ops, which `torch.compile` does only with a compiler
    toolchain and a long first call)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(_code), torch.jit.script(_decoded), torch.jit.script(_code_blocks)


class TorchLatticeCodec:
    """`LatticeCodec` over torch tensors; every step is the reference `roundtrip()`'s, in its order and dtypes
    (a one-scale spec's differ where the module docstring of `lattice.py` says)."""

    def __init__(self, spec: LatticeSpec, device: torch.device) -> None:
        self.spec = spec
        self._device = device
        codec_class = V14KakeyaZamirLatticeGPU if spec.kind == "d4" else V15KakeyaZamirE8GPU
        # The package runs on any torch device; "cuda" is only its default.
        self.reference = codec_class(D=spec.head_dim, q_range=spec.q_range, device=str(device))
        self._hadamard = self.reference.H  # [D, D], self-inverse
        self._code, self._decoded, self._code_blocks = _compiled()

    def encode(self, vectors: torch.Tensor) -> LatticeCoding:
        spec = self.spec
        flat = vectors.reshape(-1, spec.head_dim)
        lattice, norms, qmax, _ = self._code(
            flat, self._hadamard, spec.q_range, spec.block_dim, spec.kind == "e8", spec.one_scale
        )
        n = lattice.shape[0]
        return LatticeCoding(
            doubled=(lattice * 2).to(torch.int16).cpu().numpy(),
            norms=norms.reshape(n).cpu().numpy(),
            qmax=qmax.reshape(n).cpu().numpy(),
        )

    def decode(self, coding: LatticeCoding, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = coding.count
        device = self._device
        lattice = torch.from_numpy(coding.doubled).to(device).to(torch.float32) / 2  # exact: halves of integers
        norms = torch.from_numpy(coding.norms).to(device).reshape(n, 1)
        scale = torch.from_numpy(coding.qmax).to(device).to(torch.float32).reshape(n, 1) / float(self.spec.q_range)
        return self._decoded(lattice, scale, norms, self._hadamard).reshape(shape).to(dtype)

    def code_blocks(
        self, blocks: Sequence[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
    ) -> list[CodedBlock[torch.Tensor]]:
        spec = self.spec
        parts = [part for pair in blocks for part in pair]
        decoded, doubled, norms, qmax = self._code_blocks(
            parts, self._hadamard, spec.q_range, spec.block_dim, spec.kind == "e8", spec.one_scale, dtype
        )
        codings = [StagedCoding(*arrays) for arrays in zip(doubled, norms, qmax, strict=True)]
        return [(decoded[2 * i], decoded[2 * i + 1], coding) for i, coding in enumerate(codings)]

    def start_code_blocks(
        self, blocks: Sequence[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
    ) -> Callable[[], list[CodedBlock[torch.Tensor]]]:
        # A device queues the ops, so issuing them now overlaps the rest of the forward. On a CPU the pass runs here
        # too: on a thread of its own its parallel ops would contend with the model thread's for the cores (a
        # compressed session's decode step on the default model took 1.7x as long so, and its threads slowed the
        # uncompressed sessions decoding after it).
        coded = self.code_blocks(blocks, dtype)
        return lambda: coded

    def to_host(self, coding: StagedCoding[torch.Tensor]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (
            coding.doubled.to(torch.int16).cpu().numpy(),
            coding.norms.squeeze(-1).cpu().numpy(),
            coding.qmax.squeeze(-1).cpu().numpy(),
        )

    @property
    def reads_held(self) -> bool:
        return True

    def held_keys(self, coding: StagedCoding[torch.Tensor], dtype: torch.dtype) -> TorchHeldKeys:
        return TorchHeldKeys(coding, self._hadamard, self.spec.q_range, dtype, self._decoded)

    def coordinate_dtype(self) -> torch.dtype:
        return torch.int8 if 2 * self.spec.q_range <= 127 else torch.int16


def coding_matches(codec: TorchLatticeCodec, vectors: torch.Tensor) -> bool:
    """Whether decoding the coding of `vectors` gives exactly the reference `roundtrip()` output."""
    flat = vectors.reshape(-1, codec.spec.head_dim)
    decoded = codec.decode(codec.encode(flat), tuple(flat.shape), torch.float32)
    reference = codec.reference.roundtrip(flat)
    return bool(np.array_equal(decoded.cpu().numpy(), reference.cpu().numpy()))
