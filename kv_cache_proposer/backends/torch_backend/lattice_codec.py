"""KakeyaLattice on PyTorch: the `kakeyalattice` package's own rotation and closest-point search, split into the
encode and decode halves of its `roundtrip()` so the lattice coordinates can be stored."""

from __future__ import annotations

import numpy as np
import torch
from kakeyalattice import V14KakeyaZamirLatticeGPU, V15KakeyaZamirE8GPU

from kv_cache_proposer.compression.codec import LatticeCoding
from kv_cache_proposer.compression.lattice import LatticeSpec


class TorchLatticeCodec:
    """`LatticeCodec` over torch tensors; every step is the reference `roundtrip()`'s, in its order and dtypes."""

    def __init__(self, spec: LatticeSpec, device: torch.device) -> None:
        self.spec = spec
        self._device = device
        codec_class = V14KakeyaZamirLatticeGPU if spec.kind == "d4" else V15KakeyaZamirE8GPU
        # The package runs on any torch device; "cuda" is only its default.
        self.reference = codec_class(D=spec.head_dim, q_range=spec.q_range, device=str(device))
        self._hadamard = self.reference.H  # [D, D], self-inverse

    def encode(self, vectors: torch.Tensor) -> LatticeCoding:
        spec = self.spec
        flat = vectors.reshape(-1, spec.head_dim).to(torch.float32)  # [N, D]
        n = flat.shape[0]
        eps = torch.finfo(flat.dtype).eps
        norms = flat.norm(dim=1, keepdim=True).clamp(min=eps)  # [N, 1]
        unit = flat / norms
        rotated = unit @ self._hadamard
        qmax = rotated.abs().max(dim=1, keepdim=True).values.clamp(min=eps)  # [N, 1]
        qmax_f16 = qmax.to(torch.float16)
        scale = qmax_f16.to(torch.float32) / float(spec.q_range)
        blocks = (rotated / scale).reshape(n, spec.blocks, spec.block_dim)
        lattice = self.reference._closest_lattice_point(blocks).clamp(-spec.q_range, spec.q_range)
        doubled = (lattice * 2).reshape(n, spec.head_dim).to(torch.int16)
        return LatticeCoding(
            doubled=doubled.cpu().numpy(),
            norms=norms.to(torch.float16).reshape(n).cpu().numpy(),
            qmax=qmax_f16.reshape(n).cpu().numpy(),
        )

    def decode(self, coding: LatticeCoding, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        spec = self.spec
        n = coding.count
        device = self._device
        lattice = torch.from_numpy(coding.doubled).to(device).to(torch.float32) / 2  # exact: halves of integers
        scale = torch.from_numpy(coding.qmax).to(device).to(torch.float32).reshape(n, 1) / float(spec.q_range)
        rotated = (lattice.reshape(n, spec.blocks, spec.block_dim) * scale.unsqueeze(-1)).reshape(n, spec.head_dim)
        unit = rotated @ self._hadamard
        norms = torch.from_numpy(coding.norms).to(device).to(torch.float32).reshape(n, 1)
        return (unit * norms).reshape(shape).to(dtype)


def coding_matches(codec: TorchLatticeCodec, vectors: torch.Tensor) -> bool:
    """Whether decoding the coding of `vectors` gives exactly the reference `roundtrip()` output."""
    flat = vectors.reshape(-1, codec.spec.head_dim)
    decoded = codec.decode(codec.encode(flat), tuple(flat.shape), torch.float32)
    reference = codec.reference.roundtrip(flat)
    return bool(np.array_equal(decoded.cpu().numpy(), reference.cpu().numpy()))
