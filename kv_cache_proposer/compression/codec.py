"""The codec seam: what a backend provides to turn K/V vectors into lattice coordinates and back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kv_cache_proposer.cache.arrays import A
from kv_cache_proposer.compression.lattice import LatticeSpec


@dataclass(frozen=True, slots=True)
class LatticeCoding:
    """The KakeyaLattice coding of N vectors, on the host: everything decoding needs, nothing more."""

    doubled: np.ndarray  # [N, D] int16: twice the clamped lattice coordinates
    norms: np.ndarray  # [N] float16: the vectors' norms
    qmax: np.ndarray  # [N] float16: the per-vector scale (largest rotated coordinate)

    @property
    def count(self) -> int:
        return int(self.norms.shape[0])


class LatticeCodec(Protocol[A]):
    """KakeyaLattice encode / decode of `[N, D]` vectors on one backend (SPEC §6.6)."""

    @property
    def spec(self) -> LatticeSpec: ...

    def encode(self, vectors: A) -> LatticeCoding:
        """Rotate, scale and round `vectors` `[N, D]` to the lattice, exactly as the reference `roundtrip()`."""
        ...

    def decode(self, coding: LatticeCoding, shape: tuple[int, ...], dtype: Any) -> A:
        """The vectors `coding` stands for, shaped `shape` (N·D values) and cast to `dtype`: computed in float32,
        they are the reference `roundtrip()` output of the encoded input."""
        ...
