"""The KakeyaLattice bit layout: which lattice, how many bits, and how lattice points become packed bytes.

A K/V vector of dimension D is coded (by a backend's `LatticeCodec`) as D lattice coordinates in `[-Q, Q]`, split
into blocks of 4 (D4) or 8 (E8), plus an fp16 norm and an fp16 per-vector scale (qmax), or, in the one-scale
variant, the fp16 scale alone (the norm and qmax only ever multiply each other, so one number carries both and
saves 16 bits per vector: a quarter of a bit per value at D = 64). Here, on the host, every
block becomes one integer index below the number of lattice points in `[-Q, Q]^block`, written with
`bits_per_block` bits (SPEC §6.6 budget), and the blocks of a vector are bit-packed into whole bytes.

Coordinates travel doubled (`2c`, int16) so E8's half-integer coset is integral too.

Escape: the codec clamps a lattice point to `[-Q, Q]`, and a clamped point can leave the lattice (a D4 block whose
parity flip pushed one coordinate to Q+1 loses its even sum; an E8 half-integer block with a coordinate at Q+½
clamped to Q mixes the cosets). Such a block has no index. It is stored by escape: its code is 0 and its doubled
coordinates go to a side table (int16 per coordinate), so decoding still reproduces the codec's output exactly;
escaped blocks are counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np

LatticeKind = Literal["d4", "e8"]

_BLOCK_DIM = {"d4": 4, "e8": 8}
# Largest Q whose block index (a mixed-radix number over the block's coordinates) fits in a signed 64-bit integer.
MAX_Q_RANGE = {"d4": 4096, "e8": 116}
# Largest D4 Q whose mixed-radix number `(2Q+1)^4` fits in int32: indices are then computed in int32 and points read
# from a table of coordinate pairs (`(2Q+1)^2` entries), several times faster than the general int64 digits.
D4_NARROW_Q = 107


@dataclass(frozen=True, slots=True)
class LatticeSpec:
    """One lattice at one `q_range` for vectors of `head_dim` values; `one_scale`: the vector's largest rotated
    coordinate is its only fp16 scale (no separate norm)."""

    kind: LatticeKind
    head_dim: int
    q_range: int
    one_scale: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _BLOCK_DIM:
            raise ValueError(f"unknown lattice {self.kind!r}; expected d4 or e8")
        if not 1 <= self.q_range <= MAX_Q_RANGE[self.kind]:
            raise ValueError(f"q_range of {self.kind} must be in [1, {MAX_Q_RANGE[self.kind]}], got {self.q_range}")
        dim = self.head_dim
        if dim < self.block_dim or dim & (dim - 1) or dim % self.block_dim:
            raise ValueError(
                f"head_dim {dim} must be a power of two divisible by {self.block_dim} for the {self.kind} codec"
            )

    @property
    def block_dim(self) -> int:
        return _BLOCK_DIM[self.kind]

    @property
    def blocks(self) -> int:
        return self.head_dim // self.block_dim

    @property
    def bits_per_block(self) -> int:
        """SPEC §6.6: D4 `ceil(4·log2(2Q+1) − 1)`, E8 `ceil(8·log2(2Q+1))`."""
        levels = math.log2(2 * self.q_range + 1)
        real = 4.0 * levels - 1.0 if self.kind == "d4" else 8.0 * levels
        return math.ceil(real)

    @property
    def scale_bytes(self) -> int:
        """Bytes of a vector's fp16 scales: the norm and qmax, or the one scale."""
        return 2 if self.one_scale else 4

    @property
    def bits_per_vector(self) -> int:
        """The bit budget of one vector: lattice bits plus its fp16 scales."""
        return self.blocks * self.bits_per_block + 8 * self.scale_bytes

    def held_bytes(self, vectors: int, escaped_blocks: int) -> int:
        """Bytes the packed store holds for `vectors` vectors of which `escaped_blocks` blocks escaped: each vector's
        codes and scales, and each escape's key (4 int32) and doubled coordinates (int16 each)."""
        return vectors * (self.code_bytes + self.scale_bytes) + escaped_blocks * (16 + 2 * self.block_dim)

    @property
    def code_bytes(self) -> int:
        """Bytes of one vector's packed lattice codes (its lattice bits rounded up to a whole byte)."""
        return (self.blocks * self.bits_per_block + 7) // 8


def _mixed_radix(digits: np.ndarray, base: int) -> np.ndarray:
    """`digits` `[k, ...]` (each in `[0, base)`) read as one base-`base` number, most significant first."""
    out = digits[0].copy()
    for digit in digits[1:]:
        out *= base
        out += digit
    return out


def _digits(index: np.ndarray, base: int, count: int) -> np.ndarray:
    """Inverse of `_mixed_radix`: `[..., count]` digits of `index`."""
    out = np.empty((*index.shape, count), dtype=np.int64)
    rest = index.copy()
    for i in range(count - 1, -1, -1):
        out[..., i] = rest % base
        rest //= base
    return out


def block_indices(spec: LatticeSpec, doubled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index of every block of `doubled` `[N, D]` (int16, twice the lattice coordinates) and which vectors escape.

    Returns `(indices [N, blocks] int64, escaped [N, blocks] bool)`; an escaped block's index is 0.

    D4 (points of Z^4 with even sum in [-Q, Q]^4): with `a = c + Q` read as a base-(2Q+1) number n, n has the
    parity of the coordinate sum (2Q+1 is odd), so the points are exactly the even n and the index is n / 2.
    E8: integer points (D8, counted the same way) first, then half-integer points `c = b − Q + ½` with even sum:
    the first seven digits base 2Q, and the eighth digit's parity is fixed by the others, so it contributes b8 // 2.
    """
    if spec.kind == "d4" and spec.q_range <= D4_NARROW_Q:
        return _d4_indices(spec, doubled)
    q = spec.q_range
    count = doubled.shape[0]
    # Coordinate-major `[b, N·K]`: every test below is then a few passes over long rows, not reductions over
    # blocks of 4 or 8 values. Digits of blocks that escape may be anything; their index is set to 0 at the end.
    coords = np.ascontiguousarray(doubled.reshape(-1, spec.block_dim).T).astype(np.int64)
    inside = (np.abs(coords) <= 2 * q).all(axis=0)
    odd = coords & 1  # 1 where a coordinate is a half-integer
    all_int = ~odd.any(axis=0)
    base = 2 * q + 1
    int_coords = coords >> 1  # floor of the coordinate
    int_valid = all_int & ((int_coords.sum(axis=0) & 1) == 0)
    int_index = _mixed_radix(int_coords + q, base) >> 1
    if spec.kind == "d4":
        valid = inside & int_valid
        index = int_index
    else:
        # Half-integer coordinate c = (doubled) / 2: digit b = c + Q − ½ = (doubled + 2Q − 1) / 2.
        half_digits = (coords + (2 * q - 1)) >> 1
        half_sum = coords.sum(axis=0) >> 1  # the sum of the coordinates (an integer for 8 half-integers)
        half_valid = odd.all(axis=0) & ((half_sum & 1) == 0)
        valid = inside & (int_valid | half_valid)
        half_index = (base**8 + 1) // 2 + _mixed_radix(half_digits[:7], 2 * q) * q + (half_digits[7] >> 1)
        index = np.where(int_valid, int_index, half_index)
    escaped = ~valid
    index[escaped] = 0
    return index.reshape(count, spec.blocks), escaped.reshape(count, spec.blocks)


def block_points(spec: LatticeSpec, indices: np.ndarray) -> np.ndarray:
    """Inverse of `block_indices` for lattice vectors: doubled coordinates `[N, D]` int16 of `indices`."""
    if spec.kind == "d4" and spec.q_range <= D4_NARROW_Q:
        return _d4_points(spec, indices)
    q = spec.q_range
    base = 2 * q + 1
    n = indices.shape[0]
    if spec.kind == "d4":
        coords = _digits(indices * 2, base, 4) - q
        return (coords * 2).reshape(n, spec.head_dim).astype(np.int16)
    integer_count = (base**8 + 1) // 2
    is_int = indices < integer_count
    int_coords = _digits(np.where(is_int, indices, 0) * 2, base, 8) - q  # [N, K, 8]
    half = np.where(is_int, 0, indices - integer_count)
    lead = _digits(half // q, 2 * q, 7)  # [N, K, 7]
    parity = lead.sum(axis=-1) % 2  # b8 ≡ sum of the other digits (mod 2) for an even coordinate sum
    last = 2 * (half % q) + parity
    half_digits = np.concatenate([lead, last[..., None]], axis=-1)
    doubled = np.where(is_int[..., None], int_coords * 2, half_digits * 2 - 2 * q + 1)
    return doubled.reshape(n, spec.head_dim).astype(np.int16)


def _d4_indices(spec: LatticeSpec, doubled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`block_indices` for D4 at `q_range` ≤ `D4_NARROW_Q`, in int32 over `[N·K, 4]` blocks."""
    q, base = spec.q_range, 2 * spec.q_range + 1
    count = doubled.shape[0]
    blocks = np.ascontiguousarray(doubled, dtype=np.int16).reshape(-1, 4)
    # Per-block tests as one word per block: 4 bools as a uint32, 4 int16 low bits as a uint64.
    within = (blocks >= -2 * q) & (blocks <= 2 * q)
    inside = within.view(np.uint32)[:, 0] == 0x01010101
    integral = (blocks.view(np.uint64)[:, 0] & np.uint64(0x0001000100010001)) == 0  # half-integers are off D4
    digits = (np.ascontiguousarray(blocks.T).astype(np.int32) >> 1) + q  # [4, N·K]: each digit one long row
    number = digits[0] * base  # wraps harmlessly outside the range: those blocks escape
    for digit in digits[1:3]:
        number += digit
        number *= base
    number += digits[3]
    escaped = ~(inside & integral & ((number & 1) == 0))  # the number has the parity of the coordinate sum
    number >>= 1
    number[escaped] = 0
    return number.astype(np.int64).reshape(count, spec.blocks), escaped.reshape(count, spec.blocks)


@lru_cache(maxsize=8)
def _d4_pairs(q_range: int) -> np.ndarray:
    """Doubled coordinates of every two-digit number base `2Q+1`, as one int32 per pair (two int16, in order)."""
    base = 2 * q_range + 1
    number = np.arange(base * base)
    pairs = np.stack([number // base, number % base], axis=1) * 2 - 2 * q_range
    return np.ascontiguousarray(pairs.astype(np.int16)).view(np.int32)[:, 0]


def _d4_points(spec: LatticeSpec, indices: np.ndarray) -> np.ndarray:
    """`block_points` for D4 at `q_range` ≤ `D4_NARROW_Q`: the number `2·index` split in two digit pairs, each read
    from a table."""
    count = indices.shape[0]
    square = (2 * spec.q_range + 1) ** 2
    number = indices.reshape(-1).astype(np.int32)
    number <<= 1
    high = number // square
    pairs = _d4_pairs(spec.q_range)
    out = np.empty((number.shape[0], 2), dtype=np.int32)
    out[:, 0] = np.take(pairs, high)  # `take` reads int32 positions as they are; `pairs[high]` converts them first
    out[:, 1] = np.take(pairs, number - high * square)
    return out.view(np.int16).reshape(count, spec.head_dim)


def pack_codes(spec: LatticeSpec, indices: np.ndarray) -> np.ndarray:
    """`indices` `[N, blocks]` as `[N, code_bytes]` uint8: `bits_per_block` bits per block, little-endian.

    The blocks are written into little-endian 64-bit words, one shift per block (a block spans at most two
    words), block-major so that each shift runs over one contiguous row."""
    bits = spec.bits_per_block
    values = np.ascontiguousarray(indices.T).astype("<u8")  # [blocks, N]
    words = np.zeros((_words(spec), indices.shape[0]), dtype="<u8")
    for block in range(spec.blocks):
        word, shift = divmod(block * bits, 64)
        row = values[block]
        words[word] |= row << np.uint64(shift)
        if shift + bits > 64:
            words[word + 1] |= row >> np.uint64(64 - shift)
    return np.ascontiguousarray(np.ascontiguousarray(words.T).view(np.uint8)[:, : spec.code_bytes])


def unpack_codes(spec: LatticeSpec, packed: np.ndarray) -> np.ndarray:
    """Inverse of `pack_codes`: `[N, blocks]` int64."""
    bits = spec.bits_per_block
    count = packed.shape[0]
    padded = np.zeros((count, 8 * _words(spec)), dtype=np.uint8)
    padded[:, : spec.code_bytes] = packed
    words = np.ascontiguousarray(padded.view("<u8").T)  # [words, N]
    mask = np.uint64((1 << bits) - 1)
    out = np.empty((spec.blocks, count), dtype="<u8")
    for block in range(spec.blocks):
        word, shift = divmod(block * bits, 64)
        row = words[word] >> np.uint64(shift)
        if shift + bits > 64:
            row |= words[word + 1] << np.uint64(64 - shift)
        np.bitwise_and(row, mask, out=out[block])
    return np.ascontiguousarray(out.T).view(np.int64)


def _words(spec: LatticeSpec) -> int:
    """64-bit words that hold one vector's codes."""
    return (spec.blocks * spec.bits_per_block + 63) // 64
