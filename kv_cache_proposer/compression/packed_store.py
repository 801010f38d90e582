"""The packed layer store: committed K/V held as bit-packed KakeyaLattice codes plus fp16 norm and scale.

Resident entries live on the host in a `PackedCodes` (codes, fp16 norms and scales, escapes), addressed by the
session cache's slots. The stage is dense, as for every store.

While a session generates, a dense working copy holds the decoded resident entries next to the stage, so
attention reads a plain buffer and nothing packed is decoded per step. The store is lossy (see `layer_store`): a
query reads its own K/V as computed and every other position decoded. A one-token forward stages its K/V as
computed and leaves their coding to one pass of the codec over the pending entries of every layer of the cache (a
decode step then codes once, not once per layer): `start_stages` begins it when the forward's last layer has
staged, so it can run beside the rest of the forward, and `finish_stages` takes its result before the commit.
A longer forward codes its block on the backend, stages what the codes decode to (what its later queries read) and
appends the block as computed after the stage. A commit keeps the coding of the accepted entries only, and those
are bit-packed in bulk, `PACK_EVERY` entries at a time, since packing is a fixed cost per call that one token at a
time would pay every step. `park` packs what is left and drops the working copy: between generations the layer
holds packed bytes only, and the next forward decodes them again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Generic

import numpy as np

from kv_cache_proposer.cache.arrays import A, ArrayOps
from kv_cache_proposer.cache.layer_store import CommitPlan, DenseLayerStore, LayerStore, StoreFootprint
from kv_cache_proposer.compression.codec import CodedBlock, LatticeCodec, LatticeCoding, StagedCoding
from kv_cache_proposer.compression.packed_codes import PackedCodes
from kv_cache_proposer.errors import InvariantViolation

CodecFactory = Callable[[A], LatticeCodec[A]]
"""Builds the codec for a layer from its first K/V `[B, H, n, D]` (head dimension, device)."""

PACK_EVERY = 256
"""Committed entries a layer keeps as unpacked lattice coordinates (int16, on the backend) before packing them."""


class PackedLayerStore(Generic[A]):
    """`LayerStore` that holds resident K/V as packed KakeyaLattice codes."""

    lossy = True

    def __init__(self, ops: ArrayOps[A], codec_for: CodecFactory[A]) -> None:
        self._ops = ops
        self._codec_for = codec_for
        self._codec: LatticeCodec[A] | None = None
        self._work: DenseLayerStore[A] = DenseLayerStore(ops)  # the stage, plus decoded residents while working
        self._working = False
        self._capacity = 0
        self._batch = self._heads = self._itemsize = 0
        self._model_dtype: Any = None
        self._packed: PackedCodes | None = None  # the resident entries, once the layer knows its shapes
        self._staged: list[tuple[int, StagedCoding[A]]] = []  # (first stage slot, coding) of each staged piece
        self._unpacked: list[tuple[np.ndarray, StagedCoding[A]]] = []  # committed, not yet packed: (slots, coding)
        self._unpacked_count = 0
        self._coding_bytes = 0  # bytes of the staged and unpacked codings, kept as a sum: read every step
        self._committed: list[A] = []  # the coding the last commit selected, until the cache settles it
        self._pending: tuple[int, A, A] | None = None  # (stage slot, K, V) of a one-token forward, not coded yet
        self._aside: tuple[object, Callable[[], list[CodedBlock[A]]], int] | None = None  # its coding, begun:
        # (the pending entry it codes, the pass's result, this layer's index in it)
        self._own = 0  # entries appended after the stage as computed: the last forward's queries (n > 1)
        self._room = 0  # slots of the dense buffer
        self.held = 0

    # -- what is held --------------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self._codec is not None

    @property
    def packed_nbytes(self) -> int:
        """Bytes of the packed form: codes, norms, scales and escapes."""
        return 0 if self._packed is None else self._packed.nbytes

    @property
    def packed(self) -> PackedCodes | None:
        """The packed resident entries (None until the layer holds K/V)."""
        return self._packed

    @property
    def nbytes(self) -> int:
        return self.packed_nbytes + self._coding_bytes + self._work.nbytes

    def working_nbytes(self, slots: int) -> int:
        """The dense buffer (the stage and, while generating, the decoded resident entries) and the packed arrays'
        room beyond `slots`."""
        room = 0 if self._packed is None else self._packed.room_nbytes(slots)
        return self._work.nbytes + room

    def footprint(self) -> StoreFootprint:
        if self._codec is None:
            return StoreFootprint(0, 0, 0)
        dim = self._codec.spec.head_dim
        dense = 2 * self.held * self._batch * self._heads * dim * self._itemsize
        # Codings of entries committed since the last pack count as compressed bytes too (at most `PACK_EVERY`).
        compressed = self.packed_nbytes + self._coding_bytes
        return StoreFootprint(compressed, dense, self._packed_of().escaped_blocks)

    def arrays(self) -> list[A]:
        # The codings of earlier commits were settled after those commits: listing them again would make every
        # step's settle grow with the entries not yet packed.
        staged = [array for _, coding in self._staged for array in coding.arrays()]
        return self._work.arrays() + staged + self._committed

    # -- the session cache's calls -------------------------------------------------------------------------------
    def reserve(self, capacity: int) -> None:
        self._capacity = max(self._capacity, capacity)
        self._reserve_room(capacity)

    def stage(self, slot: int, keys: A, values: A) -> None:
        self._start(keys)
        self._ensure_working()
        if self._pending is not None and self._pending[0] >= slot:
            self._pending = self._aside = None  # this forward writes there again
        self._code_pending()  # an earlier forward's entry is read decoded from now on
        self._forget_staged_from(slot)
        count = self._ops.length(keys)
        if count == 1:
            self._work.stage(slot, keys, values)
            self._pending = (slot, keys, values)
            self._own = 0
            return
        decoded_keys, decoded_values, coding = self._codec_of().code_blocks([(keys, values)], self._model_dtype)[0]
        self._staged.append((slot, coding))
        self._coding_bytes += self._bytes_of(coding)
        self._reserve_room(slot + 2 * count)
        self._work.stage(slot, decoded_keys, decoded_values)
        self._work.stage(slot + count, keys, values)  # each query's own K/V, as computed
        self._own = count

    @classmethod
    def start_stages(cls, stores: Sequence[LayerStore[A]]) -> None:
        """Begin coding the pending one-token entries of every layer, in one pass of the codec that may run beside
        the rest of the forward (nothing here changes what a layer holds: `finish_stages` takes the result)."""
        pending = [store for store in _pending_of(stores) if store._aside is None]
        for group in _by_codec(pending):
            blocks = [store._pending_block() for store in group]
            result = group[0]._codec_of().start_code_blocks(blocks, group[0]._model_dtype)
            for index, store in enumerate(group):
                store._aside = (store._pending, result, index)

    @classmethod
    def finish_stages(cls, stores: Sequence[LayerStore[A]]) -> None:
        """Code the pending one-token entries of every layer in one pass of the codec (or take the pass
        `start_stages` began)."""
        pending = _pending_of(stores)
        for store in pending:
            store._take_aside()
        for group in _by_codec([store for store in pending if store._pending is not None]):
            coded = group[0]._codec_of().code_blocks([store._pending_block() for store in group], group[0]._model_dtype)
            for store, (keys, values, coding) in zip(group, coded, strict=True):
                store._take_coding(keys, values, coding)

    def read(self, stage_offset: int, end: int) -> tuple[A, A]:
        return self._work.read(stage_offset, end + self._own)

    def commit(self, plan: CommitPlan) -> None:
        self._committed = []
        if not self._working or plan.count == 0:
            self._drop_staged()
            return
        self._code_pending()
        self._own = 0
        coding = self._staged_block(plan.stage_offset, plan.count)
        if plan.slots is None or plan.sources is None:
            slots = np.arange(plan.stage_offset, plan.stage_offset + plan.count, dtype=np.int64)
            if self._ops.length(coding.doubled) != plan.count:
                coding = self._select(coding, lambda array: self._ops.head(array, plan.count))
        else:
            slots, sources = plan.slots, plan.sources
            coding = self._select(coding, lambda array: self._ops.take(array, sources))
            if slots.size:  # the accepted entries move from the stage to their ring slots
                keys, values = self._work.gather(sources + plan.stage_offset)
                self._work.load(slots, keys, values)
        self._drop_staged()
        if slots.size:
            self._committed = coding.arrays()
            self._unpacked.append((slots, coding))
            self._unpacked_count += int(slots.size)
            self._coding_bytes += self._bytes_of(coding)
        if self._unpacked_count >= PACK_EVERY:
            self._pack_unpacked()
        self.held += plan.newly_held

    def gather(self, slots: np.ndarray) -> tuple[A, A]:
        if self._codec is None:
            raise ValueError("the layer holds no K/V")
        if self._working:
            return self._work.gather(slots)
        return self._decode(0, slots), self._decode(1, slots)

    def load(self, slots: np.ndarray, keys: A, values: A) -> None:
        self._start(keys)
        self._pack_unpacked()  # earlier commits to these slots must not overwrite the loaded entries later
        rows = self._batch * self._heads
        codings = [self._codec_of().encode(array) for array in (keys, values)]
        parts = [_by_slot(coding, rows, slots.size) for coding in codings]
        doubled, norms, qmax = (np.stack(part) for part in zip(*parts, strict=True))
        self._packed_of().write(slots, doubled, norms, qmax)
        if self._working:
            shape = self._shape(slots.size)
            decoded = [self._codec_of().decode(coding, shape, self._model_dtype) for coding in codings]
            self._work.load(slots, decoded[0], decoded[1])

    def load_from(self, source: LayerStore[A], source_slots: np.ndarray, slots: np.ndarray) -> None:
        """Copy the packed codes of another packed layer (a forked session): decoding and encoding again would
        cost time and could change codes, since a decoded vector need not encode to the codes it came from."""
        if not isinstance(source, PackedLayerStore) or source._codec is None:
            self.load(slots, *source.gather(source_slots))
            return
        source._pack_unpacked()
        self._adopt_layout(source)
        self._pack_unpacked()
        self._packed_of().copy_from(source._packed_of(), source_slots, slots)
        if self._working and slots.size:
            self._work.load(slots, self._decode(0, slots), self._decode(1, slots))

    def park(self, slots: int) -> None:
        """Pack what is left, drop the decoded working copy and trim the packed arrays to the slots in use."""
        self._pack_unpacked()
        self._drop_staged()
        self._work.release()
        self._work.reserve(self._capacity)
        self._room = self._capacity
        self._working = False
        if self._packed is not None:
            self._packed.trim()

    def release(self) -> None:
        self._work.release()
        self._working = False
        self._staged.clear()
        self._unpacked.clear()
        self._unpacked_count = self._coding_bytes = 0
        self._committed = []
        if self._packed is not None:
            self._packed = PackedCodes(self._packed.spec, self._packed.rows)
        self._capacity = self._room = self._own = 0
        self._pending = self._aside = None
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
        self._packed = PackedCodes(self._codec.spec, self._batch * self._heads)

    def _adopt_layout(self, source: PackedLayerStore[A]) -> None:
        """Take the codec, shapes and dtype of `source` (a layer of the same model) if this layer has none yet."""
        if self._codec is not None:
            return
        self._codec = source._codec
        self._batch, self._heads, self._itemsize = source._batch, source._heads, source._itemsize
        self._model_dtype = source._model_dtype
        self._packed = PackedCodes(source._packed_of().spec, source._packed_of().rows)

    def _reserve_room(self, slots: int) -> None:
        """Room for `slots` in the dense buffer, grown by half at least (a block's own entries need room too)."""
        if slots > self._room:
            self._room = max(slots, self._room + self._room // 2)
            self._work.reserve(self._room)

    def _code_pending(self) -> None:
        """Code a one-token forward's entry on its own (`finish_stages` did not run since it was staged)."""
        self._take_aside()
        if self._pending is not None:
            self._take_coding(*self._codec_of().code_blocks([self._pending_block()], self._model_dtype)[0])

    def _pending_block(self) -> tuple[A, A]:
        assert self._pending is not None
        return self._pending[1], self._pending[2]

    def _take_aside(self) -> None:
        """Take the coding `start_stages` began, if it was begun for the entry still pending."""
        aside, self._aside = self._aside, None
        if aside is not None and aside[0] is self._pending:
            self._take_coding(*aside[1]()[aside[2]])

    def _take_coding(self, keys: A, values: A, coding: StagedCoding[A]) -> None:
        """Stage the decoded K/V and the coding of the pending entry in place of its computed K/V."""
        assert self._pending is not None
        slot = self._pending[0]
        self._pending = None
        self._aside = None
        self._work.stage(slot, keys, values)
        self._staged.append((slot, coding))
        self._coding_bytes += self._bytes_of(coding)

    def _ensure_working(self) -> None:
        """Decode the resident entries into a dense working copy, once per generation."""
        if self._working:
            return
        self._working = True
        slots = np.flatnonzero(self._packed_of().occupied())
        if slots.size:
            self._work.load(slots, self._decode(0, slots), self._decode(1, slots))

    def _staged_block(self, stage_offset: int, count: int) -> StagedCoding[A]:
        """The coding of stage slots `[stage_offset, stage_offset + n)`, from the pieces the forwards staged."""
        pieces = sorted(self._staged, key=lambda piece: piece[0])
        expected = stage_offset
        for start, coding in pieces:
            if start != expected:
                raise InvariantViolation("inv1", f"the stage holds codes from slot {start}, expected {expected}")
            expected += self._ops.length(coding.doubled)
        if expected - stage_offset < count:
            raise InvariantViolation("inv1", f"{count} entries committed but {expected - stage_offset} staged")
        if len(pieces) == 1:
            return pieces[0][1]
        codings = [coding for _, coding in pieces]
        return StagedCoding(
            self._ops.concat([c.doubled for c in codings]),
            self._ops.concat([c.norms for c in codings]),
            self._ops.concat([c.qmax for c in codings]),
        )

    def _bytes_of(self, coding: StagedCoding[A]) -> int:
        """Bytes of a coding's arrays: per entry, the K and V rows' int16 coordinates and fp16 norm and qmax."""
        dim = self._codec_of().spec.head_dim
        return 2 * self._batch * self._heads * (2 * dim + 4) * self._ops.length(coding.doubled)

    def _forget_staged_from(self, slot: int) -> None:
        """Forget the codes of stage slots from `slot` on: a forward writing there replaces them."""
        kept: list[tuple[int, StagedCoding[A]]] = []
        for start, coding in self._staged:
            self._coding_bytes -= self._bytes_of(coding)
            if start >= slot:
                continue
            if start + self._ops.length(coding.doubled) > slot:
                coding = self._select(coding, partial(_head, self._ops, slot - start))
            kept.append((start, coding))
            self._coding_bytes += self._bytes_of(coding)
        self._staged = kept

    def _drop_staged(self) -> None:
        self._coding_bytes -= sum(self._bytes_of(coding) for _, coding in self._staged)
        self._staged.clear()
        self._pending = self._aside = None
        self._own = 0

    @staticmethod
    def _select(coding: StagedCoding[A], pick: Callable[[A], A]) -> StagedCoding[A]:
        return StagedCoding(pick(coding.doubled), pick(coding.norms), pick(coding.qmax))

    def _pack_unpacked(self) -> None:
        """Bit-pack every committed entry still held as lattice coordinates, in one pass."""
        if not self._unpacked:
            return
        slots = np.concatenate([slots for slots, _ in self._unpacked])
        codings = [coding for _, coding in self._unpacked]
        if len(codings) > 1:
            coding = StagedCoding(
                self._ops.concat([c.doubled for c in codings]),
                self._ops.concat([c.norms for c in codings]),
                self._ops.concat([c.qmax for c in codings]),
            )
        else:
            coding = codings[0]
        self._coding_bytes -= sum(self._bytes_of(c) for c in codings)
        self._unpacked.clear()
        self._unpacked_count = 0
        self._committed = []  # read to the host below, so nothing is left to settle
        doubled, norms, qmax = self._codec_of().to_host(coding)  # [2B, H, m, D], [2B, H, m] x2
        # A ring slot written twice since the last pack keeps its latest entry.
        last_first, first_from_end = np.unique(slots[::-1], return_index=True)
        keep = slots.size - 1 - first_from_end
        rows = self._batch * self._heads
        dim = doubled.shape[-1]
        self._packed_of().write(
            last_first,
            doubled.reshape(2, rows, -1, dim)[:, :, keep].transpose(0, 2, 1, 3),  # [2, m, B·H, D]
            norms.reshape(2, rows, -1)[:, :, keep].transpose(0, 2, 1),  # [2, m, B·H]
            qmax.reshape(2, rows, -1)[:, :, keep].transpose(0, 2, 1),
        )

    def _codec_of(self) -> LatticeCodec[A]:
        if self._codec is None:
            raise ValueError("the layer holds no K/V")
        return self._codec

    def _shape(self, count: int) -> tuple[int, int, int, int]:
        assert self._codec is not None
        return (self._batch, self._heads, count, self._codec.spec.head_dim)

    def _packed_of(self) -> PackedCodes:
        if self._packed is None:
            raise ValueError("the layer holds no K/V")
        return self._packed

    def _decode(self, tensor: int, slots: np.ndarray) -> A:
        """Dense `[B, H, len(slots), D]` of the packed entries of `slots`, in the model's dtype."""
        coding = self._packed_of().read(tensor, slots)
        return self._codec_of().decode(coding, self._shape(slots.size), self._model_dtype)


def _pending_of(stores: Sequence[LayerStore[A]]) -> list[PackedLayerStore[A]]:
    return [store for store in stores if isinstance(store, PackedLayerStore) and store._pending is not None]


def _by_codec(stores: list[PackedLayerStore[A]]) -> list[list[PackedLayerStore[A]]]:
    """`stores` grouped by what one codec pass can take together: lattice, dtype and K/V shape."""
    groups: dict[tuple[Any, ...], list[PackedLayerStore[A]]] = {}
    for store in stores:
        key: Any = (store._codec_of().spec, store._model_dtype, tuple(store._pending_block()[0].shape))  # type: ignore[attr-defined]
        groups.setdefault(key, []).append(store)
    return list(groups.values())


def _by_slot(coding: LatticeCoding, rows: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A coding of `[B, H, m]` vectors reordered slot-major: `[m, B·H, D]`, `[m, B·H]`, `[m, B·H]`."""
    doubled = coding.doubled.reshape(rows, count, -1).transpose(1, 0, 2)
    return doubled, coding.norms.reshape(rows, count).T, coding.qmax.reshape(rows, count).T


def _head(ops: ArrayOps[A], count: int, array: A) -> A:
    return ops.head(array, count)
