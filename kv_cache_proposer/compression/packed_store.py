"""The packed layer store: committed K/V held as bit-packed KakeyaLattice codes plus fp16 norm and scale.

Resident entries live on the host as `[2 (K, V), slots, B·H, code_bytes]` uint8 codes and `[2, slots, B·H]`
fp16 norms and scales, addressed by the session cache's slots; vectors the lattice cannot index after clamping live
in a side table of escaped blocks (see `lattice.py`). The stage is dense, as for every store.

While a session generates, a dense working copy holds the decoded resident entries next to the stage, so a
decode step encodes only the entries it accepts and attention reads a plain buffer. `park()` drops that copy:
between generations the layer holds packed bytes only, and the next forward decodes them again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic

import numpy as np

from kv_cache_proposer.cache.arrays import A, ArrayOps
from kv_cache_proposer.cache.layer_store import CommitPlan, DenseLayerStore, StoreFootprint
from kv_cache_proposer.compression.codec import LatticeCodec, LatticeCoding
from kv_cache_proposer.compression.lattice import block_indices, block_points, pack_codes, unpack_codes

CodecFactory = Callable[[A], LatticeCodec[A]]
"""Builds the codec for a layer from its first K/V `[B, H, n, D]` (head dimension, device)."""


class PackedLayerStore(Generic[A]):
    """`LayerStore` that holds resident K/V as packed KakeyaLattice codes."""

    def __init__(self, ops: ArrayOps[A], codec_for: CodecFactory[A]) -> None:
        self._ops = ops
        self._codec_for = codec_for
        self._codec: LatticeCodec[A] | None = None
        self._work: DenseLayerStore[A] = DenseLayerStore(ops)  # the stage, plus decoded residents while working
        self._working = False
        self._capacity = 0
        self._batch = self._heads = self._itemsize = 0
        self._model_dtype: Any = None
        self._codes = np.zeros((2, 0, 0, 0), dtype=np.uint8)  # [2, slots, B·H, code_bytes]
        self._norms = np.zeros((2, 0, 0), dtype=np.float16)  # [2, slots, B·H]
        self._qmax = np.zeros((2, 0, 0), dtype=np.float16)  # [2, slots, B·H]
        self._escape_keys = np.zeros((0, 4), dtype=np.int32)  # [E, (tensor, slot, row, block)]
        self._escape_points = np.zeros((0, 0), dtype=np.int16)  # [E, block_dim]: doubled coordinates
        # Codes of staged entries by (tensor, slot): packed only if a commit accepts them.
        self._pending: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.held = 0

    # -- what is held --------------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self._codec is not None

    @property
    def packed_nbytes(self) -> int:
        """Bytes of the packed form: codes, norms, scales and escapes."""
        escapes = self._escape_keys.nbytes + self._escape_points.nbytes
        return int(self._codes.nbytes + self._norms.nbytes + self._qmax.nbytes + escapes)

    @property
    def nbytes(self) -> int:
        return self.packed_nbytes + self._work.nbytes

    def footprint(self) -> StoreFootprint:
        if self._codec is None:
            return StoreFootprint(0, 0, 0)
        dim = self._codec.spec.head_dim
        dense = 2 * self.held * self._batch * self._heads * dim * self._itemsize
        return StoreFootprint(self.packed_nbytes, dense, int(self._escape_keys.shape[0]))

    def arrays(self) -> list[A]:
        return self._work.arrays()

    # -- the session cache's calls -------------------------------------------------------------------------------
    def reserve(self, capacity: int) -> None:
        self._capacity = max(self._capacity, capacity)
        self._work.reserve(capacity)

    def stage(self, slot: int, keys: A, values: A) -> None:
        self._start(keys)
        self._ensure_working()
        count = self._ops.length(keys)
        decoded = []
        for tensor, array in enumerate((keys, values)):
            coding = self._codec_of().encode(array)  # rows in [B, H, n] order
            decoded.append(self._codec_of().decode(coding, self._shape(count), self._model_dtype))
            doubled, norms, qmax = _by_slot(coding, self._batch * self._heads, count)
            for i in range(count):
                self._pending[(tensor, slot + i)] = (doubled[i], norms[i], qmax[i])
        # The stage holds what its codes decode to, so a block reads its own earlier positions as later forwards
        # will read them once resident: speculative and one-token decoding see the same K/V.
        self._work.stage(slot, decoded[0], decoded[1])

    def read(self, stage_offset: int, end: int) -> tuple[A, A]:
        return self._work.read(stage_offset, end)

    def commit(self, plan: CommitPlan) -> None:
        if not self._working or plan.count == 0:
            return
        if plan.slots is None or plan.sources is None:
            sources = np.arange(plan.count, dtype=np.int64)
            slots = sources + plan.stage_offset
        else:
            sources, slots = plan.sources, plan.slots
        if slots.size:
            staged = (sources + plan.stage_offset).tolist()
            for tensor in (0, 1):
                entries = [self._pending[(tensor, s)] for s in staged]
                doubled, norms, qmax = (np.stack(part) for part in zip(*entries, strict=True))
                self._pack(tensor, slots, doubled, norms, qmax)
            if plan.slots is not None:  # the accepted entries move from the stage to their ring slots
                keys, values = self._work.gather(sources + plan.stage_offset)
                self._work.load(slots, keys, values)
        self._pending.clear()
        self.held += plan.newly_held

    def gather(self, slots: np.ndarray) -> tuple[A, A]:
        if self._codec is None:
            raise ValueError("the layer holds no K/V")
        if self._working:
            return self._work.gather(slots)
        return self._decode(0, slots), self._decode(1, slots)

    def load(self, slots: np.ndarray, keys: A, values: A) -> None:
        self._start(keys)
        self._reserve_slots(int(slots.max()) + 1 if slots.size else 0)
        rows = self._batch * self._heads
        decoded = []
        for tensor, array in enumerate((keys, values)):
            coding = self._codec_of().encode(array)
            self._pack(tensor, slots, *_by_slot(coding, rows, slots.size))
            decoded.append(self._codec_of().decode(coding, self._shape(slots.size), self._model_dtype))
        if self._working:
            self._work.load(slots, decoded[0], decoded[1])

    def park(self) -> None:
        """Drop the decoded working copy and trim the packed arrays to the slots in use."""
        self._work.release()
        self._work.reserve(self._capacity)
        self._working = False
        self._pending.clear()
        occupied = np.flatnonzero(self._occupied())
        self._resize(int(occupied[-1]) + 1 if occupied.size else 0)

    def release(self) -> None:
        self._work.release()
        self._working = False
        self._pending.clear()
        self._codes = np.zeros((2, 0, 0, 0), dtype=np.uint8)
        self._norms = np.zeros((2, 0, 0), dtype=np.float16)
        self._qmax = np.zeros((2, 0, 0), dtype=np.float16)
        self._escape_keys = np.zeros((0, 4), dtype=np.int32)
        self._escape_points = np.zeros((0, 0), dtype=np.int16)
        self._capacity = 0
        self.held = 0

    # -- internals -------------------------------------------------------------------------------------------------
    def _start(self, like: A) -> None:
        """Learn the layer's shapes and dtype from its first K/V `[B, H, n, D]`."""
        if self._codec is not None:
            return
        shape: Any = like.shape  # type: ignore[attr-defined]
        self._batch, self._heads, count, dim = (int(s) for s in shape)
        self._codec = self._codec_for(like)
        self._model_dtype = self._ops.dtype(like)
        self._itemsize = self._ops.nbytes(like) // max(1, self._batch * self._heads * count * dim)
        rows, code_bytes = self._batch * self._heads, self._codec.spec.code_bytes
        self._codes = np.zeros((2, 0, rows, code_bytes), dtype=np.uint8)
        self._norms = np.zeros((2, 0, rows), dtype=np.float16)
        self._qmax = np.zeros((2, 0, rows), dtype=np.float16)
        self._escape_points = np.zeros((0, self._codec.spec.block_dim), dtype=np.int16)

    def _ensure_working(self) -> None:
        """Decode the resident entries into a dense working copy, once per generation."""
        if self._working:
            return
        self._working = True
        slots = np.flatnonzero(self._occupied())
        if slots.size:
            self._work.load(slots, self._decode(0, slots), self._decode(1, slots))

    def _resize(self, slots: int) -> None:
        def resized(array: np.ndarray) -> np.ndarray:
            out = np.zeros((2, slots, *array.shape[2:]), dtype=array.dtype)
            kept = min(slots, array.shape[1])
            out[:, :kept] = array[:, :kept]
            return out

        self._codes, self._norms, self._qmax = resized(self._codes), resized(self._norms), resized(self._qmax)

    def _occupied(self) -> np.ndarray:
        """Whether each packed slot holds an entry `[slots]`: a written entry's fp16 scale is never 0 (the codec
        clamps it to float32 eps, which fp16 keeps as a subnormal)."""
        return self._qmax[0, :, 0] > 0

    def _reserve_slots(self, needed: int) -> None:
        slots = self._qmax.shape[1]
        if needed > slots:
            self._resize(max(needed, slots + slots // 2))

    def _codec_of(self) -> LatticeCodec[A]:
        if self._codec is None:
            raise ValueError("the layer holds no K/V")
        return self._codec

    def _shape(self, count: int) -> tuple[int, int, int, int]:
        assert self._codec is not None
        return (self._batch, self._heads, count, self._codec.spec.head_dim)

    def _pack(self, tensor: int, slots: np.ndarray, doubled: np.ndarray, norms: np.ndarray, qmax: np.ndarray) -> None:
        """Write slot-major codings (`doubled` `[m, B·H, D]`, `norms`/`qmax` `[m, B·H]`) into `slots`."""
        spec = self._codec_of().spec
        count, rows = norms.shape
        self._reserve_slots(int(slots.max()) + 1)
        flat_doubled = doubled.reshape(count * rows, spec.head_dim)
        indices, escaped = block_indices(spec, flat_doubled)  # [m·B·H, blocks] x2
        self._codes[tensor, slots] = pack_codes(spec, indices).reshape(count, rows, -1)
        self._norms[tensor, slots] = norms
        self._qmax[tensor, slots] = qmax
        # The new entries replace whatever escapes the slots held.
        stale = (self._escape_keys[:, 0] == tensor) & np.isin(self._escape_keys[:, 1], slots)
        keys, points = self._escape_keys[~stale], self._escape_points[~stale]
        flat, block = np.nonzero(escaped)
        if flat.size:
            i, row = np.divmod(flat, rows)
            new_keys = np.stack([np.full_like(row, tensor), slots[i], row, block], axis=1).astype(np.int32)
            blocks = flat_doubled.reshape(-1, spec.blocks, spec.block_dim)
            keys = np.concatenate([keys, new_keys])
            points = np.concatenate([points, blocks[flat, block]])
        self._escape_keys, self._escape_points = keys, points

    def _decode(self, tensor: int, slots: np.ndarray) -> A:
        """Dense `[B, H, len(slots), D]` of the packed entries of `slots`, in the model's dtype."""
        assert self._codec is not None
        spec = self._codec.spec
        rows, count = self._batch * self._heads, slots.size
        codes = self._codes[tensor, slots].transpose(1, 0, 2).reshape(rows * count, -1)  # [B·H·m, bytes]
        doubled = block_points(spec, unpack_codes(spec, codes))
        if self._escape_keys.size and count:
            keys = self._escape_keys
            order = np.full(max(int(slots.max()), int(keys[:, 1].max())) + 1, -1, dtype=np.int64)
            order[slots] = np.arange(count)  # slot -> its column in this read
            hit = (keys[:, 0] == tensor) & (order[keys[:, 1]] >= 0)
            if hit.any():
                blocks = doubled.reshape(rows * count, spec.blocks, spec.block_dim)
                vector = keys[hit, 2] * count + order[keys[hit, 1]]
                blocks[vector, keys[hit, 3]] = self._escape_points[hit]
                doubled = blocks.reshape(rows * count, spec.head_dim)
        coding = LatticeCoding(
            doubled=doubled,
            norms=self._norms[tensor, slots].transpose(1, 0).reshape(-1),
            qmax=self._qmax[tensor, slots].transpose(1, 0).reshape(-1),
        )
        return self._codec.decode(coding, self._shape(count), self._model_dtype)


def _by_slot(coding: LatticeCoding, rows: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A coding of `[B, H, m]` vectors reordered slot-major: `[m, B·H, D]`, `[m, B·H]`, `[m, B·H]`."""
    doubled = coding.doubled.reshape(rows, count, -1).transpose(1, 0, 2)
    return doubled, coding.norms.reshape(rows, count).T, coding.qmax.reshape(rows, count).T
