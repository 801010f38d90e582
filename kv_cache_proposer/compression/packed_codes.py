"""The packed entries of one layer, on the host: bit-packed KakeyaLattice codes, fp16 norms and scales, escapes.

Entries are addressed by (tensor, slot, row): tensor 0 is K and 1 is V, slots are the session cache's, rows are the
batch × KV heads of one position. Codes are `[2, slots, rows, code_bytes]` uint8 and norms and scales `[2, slots,
rows]` fp16 (a one-scale lattice holds no norms: its codec writes 1.0 there, and reads get 1.0 back); a block the
lattice cannot index after clamping is kept by escape (see `lattice.py`): its code is 0 and its doubled
coordinates sit in a side table keyed by (tensor, slot, row, block).
"""

from __future__ import annotations

import numpy as np

from kv_cache_proposer.compression.codec import LatticeCoding
from kv_cache_proposer.compression.lattice import LatticeSpec, block_indices, block_points, pack_codes, unpack_codes


class PackedCodes:
    """Packed K and V entries of one layer, by slot."""

    def __init__(self, spec: LatticeSpec, rows: int) -> None:
        self.spec = spec
        self.rows = rows
        self.codes = np.zeros((2, 0, rows, spec.code_bytes), dtype=np.uint8)
        self.norms = None if spec.one_scale else np.zeros((2, 0, rows), dtype=np.float16)
        self.qmax = np.zeros((2, 0, rows), dtype=np.float16)
        self.escape_keys = np.zeros((0, 4), dtype=np.int32)  # [E, (tensor, slot, row, block)]
        self.escape_points = np.zeros((0, spec.block_dim), dtype=np.int16)  # [E, block_dim]: doubled coordinates

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, norms, scales and escapes."""
        escapes = self.escape_keys.nbytes + self.escape_points.nbytes
        norms = 0 if self.norms is None else self.norms.nbytes
        return int(self.codes.nbytes + norms + self.qmax.nbytes + escapes)

    @property
    def escaped_blocks(self) -> int:
        return int(self.escape_keys.shape[0])

    def occupied(self) -> np.ndarray:
        """Whether each slot holds an entry `[slots]`: a written entry's fp16 scale is never 0 (the codec clamps it
        to float32 eps, which fp16 keeps as a subnormal)."""
        return self.qmax[0, :, 0] > 0

    def room_nbytes(self, slots: int) -> int:
        """Bytes of the room after the first `slots` slots (what `trim` drops when they hold every entry)."""
        spare = self.qmax.shape[1] - slots
        return 0 if spare <= 0 else spare * 2 * self.rows * (self.spec.code_bytes + self.spec.scale_bytes)

    def reserve(self, needed: int) -> None:
        """Room for `needed` slots, growing by half at least (appends stay amortised O(1))."""
        slots = self.qmax.shape[1]
        if needed > slots:
            self._resize(max(needed, slots + slots // 2))

    def trim(self) -> None:
        """Drop the room after the last occupied slot."""
        occupied = np.flatnonzero(self.occupied())
        self._resize(int(occupied[-1]) + 1 if occupied.size else 0)

    def write(self, slots: np.ndarray, doubled: np.ndarray, norms: np.ndarray, qmax: np.ndarray) -> None:
        """Write slot-major codings of K and V (`doubled` `[2, m, rows, D]`, `norms`/`qmax` `[2, m, rows]`) into
        `slots` (distinct), replacing what they held."""
        spec = self.spec
        _, count, rows = norms.shape
        if count == 0:
            return
        self.reserve(int(slots.max()) + 1)
        flat_doubled = doubled.reshape(2 * count * rows, spec.head_dim)
        indices, escaped = block_indices(spec, flat_doubled)  # [2·m·rows, blocks] x2
        self.codes[:, slots] = pack_codes(spec, indices).reshape(2, count, rows, -1)
        if self.norms is not None:
            self.norms[:, slots] = norms
        self.qmax[:, slots] = qmax
        keys, points = self._escapes_outside(slots)
        flat, block = np.nonzero(escaped)
        if flat.size:
            tensor, vector = np.divmod(flat, count * rows)
            i, row = np.divmod(vector, rows)
            new_keys = np.stack([tensor, slots[i], row, block], axis=1).astype(np.int32)
            blocks = flat_doubled.reshape(-1, spec.blocks, spec.block_dim)
            keys = np.concatenate([keys, new_keys])
            points = np.concatenate([points, blocks[flat, block]])
        self.escape_keys, self.escape_points = keys, points

    def write_vectors(self, slots: np.ndarray, keys: LatticeCoding, values: LatticeCoding) -> None:
        """Write the codings of K and V of `[B, H, len(slots)]` vectors (row-major, as a codec encodes them)."""
        count = slots.size
        parts = [
            (
                coding.doubled.reshape(self.rows, count, -1).transpose(1, 0, 2),  # [m, B·H, D]
                coding.norms.reshape(self.rows, count).T,  # [m, B·H]
                coding.qmax.reshape(self.rows, count).T,
            )
            for coding in (keys, values)
        ]
        doubled, norms, qmax = (np.stack(part) for part in zip(*parts, strict=True))
        self.write(slots, doubled, norms, qmax)

    def write_staged(self, slots: np.ndarray, doubled: np.ndarray, norms: np.ndarray, qmax: np.ndarray) -> None:
        """Write codings laid out as a `StagedCoding` on the host (`LatticeCodec.to_host`: doubled `[2·B, H, m, D]`,
        norms and qmax `[2·B, H, m]`) into `slots`; a slot named twice (a ring slot written twice since the last
        pack) keeps its later entry."""
        last_first, first_from_end = np.unique(slots[::-1], return_index=True)
        keep = slots.size - 1 - first_from_end
        rows, dim = self.rows, doubled.shape[-1]
        self.write(
            last_first,
            doubled.reshape(2, rows, -1, dim)[:, :, keep].transpose(0, 2, 1, 3),  # [2, m, B·H, D]
            norms.reshape(2, rows, -1)[:, :, keep].transpose(0, 2, 1),  # [2, m, B·H]
            qmax.reshape(2, rows, -1)[:, :, keep].transpose(0, 2, 1),
        )

    def copy_from(self, source: PackedCodes, source_slots: np.ndarray, slots: np.ndarray) -> None:
        """Hold the entries `source_slots` of `source` (same lattice and rows) as those of `slots`, code for code."""
        if not slots.size:
            return
        self.reserve(int(slots.max()) + 1)
        self.codes[:, slots] = source.codes[:, source_slots]
        if self.norms is not None and source.norms is not None:
            self.norms[:, slots] = source.norms[:, source_slots]
        self.qmax[:, slots] = source.qmax[:, source_slots]
        keys, points = self._escapes_outside(slots)
        theirs = source.escape_keys
        if theirs.size:
            target = np.full(max(int(theirs[:, 1].max()), int(source_slots.max())) + 1, -1, dtype=np.int64)
            target[source_slots] = slots  # source slot -> slot here
            hit = target[theirs[:, 1]] >= 0
            copied = theirs[hit].copy()
            copied[:, 1] = target[copied[:, 1]]
            keys = np.concatenate([keys, copied])
            points = np.concatenate([points, source.escape_points[hit]])
        self.escape_keys, self.escape_points = keys, points

    def read(self, tensor: int, slots: np.ndarray) -> LatticeCoding:
        """The coding of `tensor`'s entries in `slots`, row-major (`[rows · len(slots)]` vectors), escapes restored."""
        spec = self.spec
        rows, count = self.rows, slots.size
        codes = self.codes[tensor, slots].transpose(1, 0, 2).reshape(rows * count, -1)  # [rows·m, bytes]
        doubled = block_points(spec, unpack_codes(spec, codes))
        keys = self.escape_keys
        if keys.size and count:
            order = np.full(max(int(slots.max()), int(keys[:, 1].max())) + 1, -1, dtype=np.int64)
            order[slots] = np.arange(count)  # slot -> its column in this read
            hit = (keys[:, 0] == tensor) & (order[keys[:, 1]] >= 0)
            if hit.any():
                blocks = doubled.reshape(rows * count, spec.blocks, spec.block_dim)
                vector = keys[hit, 2] * count + order[keys[hit, 1]]
                blocks[vector, keys[hit, 3]] = self.escape_points[hit]
                doubled = blocks.reshape(rows * count, spec.head_dim)
        if self.norms is None:
            norms = np.ones(rows * count, dtype=np.float16)
        else:
            norms = self.norms[tensor, slots].transpose(1, 0).reshape(-1)
        return LatticeCoding(
            doubled=doubled,
            norms=norms,
            qmax=self.qmax[tensor, slots].transpose(1, 0).reshape(-1),
        )

    def _escapes_outside(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The escape table without the entries of `slots` (about to be replaced)."""
        stale = np.isin(self.escape_keys[:, 1], slots)
        return self.escape_keys[~stale], self.escape_points[~stale]

    def _resize(self, slots: int) -> None:
        def resized(array: np.ndarray) -> np.ndarray:
            out = np.zeros((2, slots, *array.shape[2:]), dtype=array.dtype)
            kept = min(slots, array.shape[1])
            out[:, :kept] = array[:, :kept]
            return out

        self.codes, self.qmax = resized(self.codes), resized(self.qmax)
        if self.norms is not None:
            self.norms = resized(self.norms)
