"""The codec seam: what a backend provides to turn K/V vectors into lattice coordinates and back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol

import numpy as np

from kv_cache_proposer.cache.arrays import A
from kv_cache_proposer.cache.protocol import HeldKeys
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


@dataclass(frozen=True, slots=True)
class StagedCoding(Generic[A]):
    """The coding of a block's K and V, left on the backend and laid out like K/V (slots on axis 2), so a commit
    can pick the accepted entries with the cache's array operations before anything is packed."""

    doubled: A  # [2·B, H, n, D] int16: the K rows, then the V rows
    norms: A  # [2·B, H, n, 1] float16
    qmax: A  # [2·B, H, n, 1] float16

    def arrays(self) -> list[A]:
        return [self.doubled, self.norms, self.qmax]


CodedBlock = tuple[A, A, StagedCoding[A]]
"""A block's decoded K, decoded V and coding, as `LatticeCodec.code_blocks` gives them."""


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

    def code_blocks(self, blocks: Sequence[tuple[A, A]], dtype: Any) -> list[CodedBlock[A]]:
        """Encode blocks' `keys` and `values` `[B, H, n, D]` (same H, n and D; several layers' blocks, say) in one
        pass without leaving the backend: per block, what its K and V decode to (in `dtype`, the values `decode`
        gives for the same coding) and their coding. Each vector is coded alone: batching changes no value."""
        ...

    def start_code_blocks(self, blocks: Sequence[tuple[A, A]], dtype: Any) -> Callable[[], list[CodedBlock[A]]]:
        """`code_blocks` begun now and finished by calling the result (which returns the same list every time).
        A device that queues its ops (or builds a lazy graph) overlaps the pass with the rest of the forward; on a
        CPU the pass runs here, since a helper thread's parallel ops would take the model thread's cores."""
        ...

    def to_host(self, coding: StagedCoding[A]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`coding` on the host: doubled `[2·B, H, n, D]` int16, norms and qmax `[2·B, H, n]` float16."""
        ...

    @property
    def reads_held(self) -> bool:
        """Whether this backend's attention reads K/V as coded (`held_keys`); otherwise a generating session keeps
        its resident entries decoded."""
        ...

    def held_keys(self, coding: StagedCoding[A], dtype: Any) -> HeldKeys[A]:
        """The K/V `coding` stands for (laid out as `StagedCoding`), for attention to read without decoding them
        all; `dense()` gives what `decode` gives, in `dtype`."""
        ...

    def coordinate_dtype(self) -> Any:
        """The backend integer dtype a held coding keeps its doubled coordinates in: the narrowest that holds
        `[-2Q, 2Q]`."""
        ...


def split_stacked(
    blocks: Sequence[tuple[A, A]], decoded: A, coding: StagedCoding[A]
) -> list[tuple[A, A, StagedCoding[A]]]:
    """Per block of `code_blocks`, its decoded K, decoded V and coding, from the stacked results (each block's K
    rows, then its V rows, block after block on axis 0)."""
    out = []
    row = 0
    stacked: Any = decoded
    for keys, _ in blocks:
        batch = int(keys.shape[0])  # type: ignore[attr-defined]
        mid, end = row + batch, row + 2 * batch
        part = StagedCoding(*(array[row:end] for array in coding.arrays()))  # type: ignore[index]
        out.append((stacked[row:mid], stacked[mid:end], part))
        row = end
    return out
