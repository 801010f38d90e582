"""What a packed layer holds only while its session generates, beside its packed codes: the resident entries
unpacked, so nothing packed is decoded per step, and the dense stage of the forward in flight. Two forms:

- `HeldWorking`: the residents as lattice coordinates (`HeldResidents`, about a quarter of the dense bytes), which
  attention reads part by part without decoding them (`HeldKeys`); the stage is a small dense buffer of its own.
- `DecodedWorking`: the residents decoded into one dense buffer with the stage after them, for an attention that
  reads dense K/V only (MLX, transformers' modules).

Both take resident entries as host codings (`load`) or as a commit's staged coding, and hand attention what it
reads (`read_parts`). The packed layer store (`packed_store`) chooses the form when a generation begins
(`new_working`), from what it learnt of its first K/V (`PackedLayout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Protocol

import numpy as np

from kv_cache_proposer.cache.arrays import A, ArrayOps
from kv_cache_proposer.cache.layer_store import CommitPlan, DenseLayerStore
from kv_cache_proposer.cache.protocol import KeyPart
from kv_cache_proposer.compression.codec import LatticeCodec, LatticeCoding, StagedCoding
from kv_cache_proposer.compression.held_residents import HeldResidents
from kv_cache_proposer.errors import InvariantViolation

STAGE_ROOM = 64
"""Dense stage slots `HeldWorking` keeps between forwards: room for a decode step or a speculative block read
twice; a larger stage (a prefill chunk's) is dropped at its commit."""


@dataclass(frozen=True, slots=True)
class PackedLayout(Generic[A]):
    """What a packed layer learns from its first K/V: the codec and the K/V's shape and dtype."""

    codec: LatticeCodec[A]
    batch: int
    heads: int
    itemsize: int  # bytes of one value in the model's dtype
    model_dtype: Any

    @property
    def rows(self) -> int:
        return self.batch * self.heads

    @property
    def entry_coding_bytes(self) -> int:
        """Bytes of one entry's coding: the K and V rows' int16 coordinates and fp16 norm and qmax."""
        return 2 * self.rows * (2 * self.codec.spec.head_dim + 4)

    def shape(self, count: int) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, count, self.codec.spec.head_dim)


class WorkingResidents(Protocol[A]):
    """A generating packed layer's unpacked residents and dense stage, addressed by the session cache's slots."""

    @property
    def nbytes(self) -> int: ...

    def arrays(self) -> list[A]: ...

    def reserve(self, capacity: int) -> None:
        """Room for `capacity` resident and staged slots."""
        ...

    def stage(self, slot: int, keys: A, values: A) -> None:
        """Write `keys`/`values` `[B, H, n, D]` into stage slots `[slot, slot + n)`."""
        ...

    def read_parts(self, stage_offset: int, end: int) -> list[KeyPart[A]]:
        """Slots `[0, end)`: the residents before `stage_offset`, then the stage."""
        ...

    def commit(self, plan: CommitPlan, slots: np.ndarray, coding: StagedCoding[A]) -> None:
        """The accepted entries become the residents of `slots`, with their `coding` (the stage is dropped after,
        by `drop_stage`)."""
        ...

    def drop_stage(self) -> None:
        """Forget the stage: after a commit, or when nothing was committed."""
        ...

    def stage_read(self) -> None:
        """The forward's one model call has read the stage (`ReadOnceStage`): drop what the commit does not need."""
        ...

    def gather(self, slots: np.ndarray) -> tuple[A, A]:
        """Dense K/V of resident `slots`."""
        ...

    def load(self, slots: np.ndarray, keys: LatticeCoding, values: LatticeCoding) -> None:
        """Hold host codings of K and V (`PackedCodes.read` order) as the residents of `slots`."""
        ...


class HeldWorking(Generic[A]):
    """Residents as lattice coordinates, and a dense stage whose slot s is the buffer's `s - base`."""

    def __init__(
        self, ops: ArrayOps[A], codec: LatticeCodec[A], sample: StagedCoding[A], dtype: Any, batch: int
    ) -> None:
        """`sample`: any coding on this backend (it shows the arrays' dtypes and device); `dtype`: the model's."""
        self._ops = ops
        self._codec = codec
        self._dtype = dtype
        self._batch = batch
        self._residents: HeldResidents[A] = HeldResidents(ops, codec, sample, dtype)
        self._stage: DenseLayerStore[A] = DenseLayerStore(ops)
        self._room = 0
        self._base: int | None = None  # the first slot of the stage in flight (None: no stage)
        self._stage_gone = False  # the stage in flight was dropped once its attention read it (`stage_read`)
        self.stands_for_codes = False  # the packed codes were dropped: these residents are all the layer holds

    @property
    def nbytes(self) -> int:
        return self._residents.nbytes + self._stage.nbytes

    @property
    def residents_nbytes(self) -> int:
        return self._residents.nbytes

    def resident_slots(self) -> np.ndarray:
        """The slots that hold a resident entry."""
        return self._residents.occupied()

    def take(self, slots: np.ndarray) -> StagedCoding[A]:
        """The coding of resident `slots`."""
        return self._residents.take(slots)

    def arrays(self) -> list[A]:
        return self._residents.arrays() + self._stage.arrays()

    def reserve(self, capacity: int) -> None:
        self._residents.reserve(capacity)

    def stage(self, slot: int, keys: A, values: A) -> None:
        if slot != self._base:  # an extension reads the entries before it; a block staged again replaces them
            self._check_stage()
        self._stage_gone = False
        if self._base is None:
            self._base = slot  # a fresh stage starts at the stage's first slot
        at = slot - self._base
        needed = at + self._ops.length(keys)
        if needed > self._room:
            self._room = max(needed, self._room + self._room // 2)
            self._stage.reserve(self._room)
        self._stage.stage(at, keys, values)

    def read_parts(self, stage_offset: int, end: int) -> list[KeyPart[A]]:
        self._check_stage()
        staged = self._stage.read(0, end - stage_offset)
        return [self._residents.keys(stage_offset), staged] if stage_offset else [staged]

    def commit(self, plan: CommitPlan, slots: np.ndarray, coding: StagedCoding[A]) -> None:
        if slots.size:
            self._residents.put(slots, coding)

    def drop_stage(self) -> None:
        self._base = None
        self._stage_gone = False
        if self._room > STAGE_ROOM:  # a prefill chunk's stage is not kept for decoding
            self._stage.release()
            self._room = 0

    def stage_read(self) -> None:
        """A prefill chunk's stage (larger than `STAGE_ROOM`) goes as soon as its attention has read it: the
        commit puts the block's coding. A decode step's or a speculative block's stays, reused by the next."""
        if self._room > STAGE_ROOM:
            self._stage.release()
            self._room = 0
            self._stage_gone = True

    def _check_stage(self) -> None:
        if self._stage_gone:
            raise InvariantViolation("inv1", "a forward extends or reads a stage dropped once its attention read it")

    def gather(self, slots: np.ndarray) -> tuple[A, A]:
        return self._codec.held_keys(self._residents.take(slots), self._dtype).dense()

    def trim(self, slots: int) -> None:
        """Keep the residents of the first `slots` slots, without room or a stage: between generations."""
        self._residents.trim(slots)
        self._stage.release()
        self._room = 0
        self._base = None

    def load(self, slots: np.ndarray, keys: LatticeCoding, values: LatticeCoding) -> None:
        if slots.size:
            self._residents.put_host(slots, keys, values, self._batch)


class DecodedWorking(Generic[A]):
    """Residents decoded into one dense buffer, by slot, with the stage after them."""

    def __init__(self, ops: ArrayOps[A], codec: LatticeCodec[A], dtype: Any, shape: tuple[int, int, int]) -> None:
        """`shape`: the K/V's batch, heads and head size."""
        self._ops = ops
        self._codec = codec
        self._dtype = dtype
        self._shape = shape
        self._dense: DenseLayerStore[A] = DenseLayerStore(ops)
        self._room = 0

    @property
    def nbytes(self) -> int:
        return self._dense.nbytes

    def arrays(self) -> list[A]:
        return self._dense.arrays()

    def reserve(self, capacity: int) -> None:
        self._grow(capacity)

    def stage(self, slot: int, keys: A, values: A) -> None:
        self._grow(slot + self._ops.length(keys))
        self._dense.stage(slot, keys, values)

    def read_parts(self, stage_offset: int, end: int) -> list[KeyPart[A]]:
        return [self._dense.read(stage_offset, end)]

    def commit(self, plan: CommitPlan, slots: np.ndarray, coding: StagedCoding[A]) -> None:
        if plan.sources is not None and slots.size:  # the accepted entries move from the stage to their ring slots
            self._dense.load(slots, *self._dense.gather(plan.sources + plan.stage_offset))

    def drop_stage(self) -> None:
        return None

    def stage_read(self) -> None:
        return None  # the stage's entries become the residents in place

    def gather(self, slots: np.ndarray) -> tuple[A, A]:
        return self._dense.gather(slots)

    def load(self, slots: np.ndarray, keys: LatticeCoding, values: LatticeCoding) -> None:
        if not slots.size:
            return
        batch, heads, dim = self._shape
        shape = (batch, heads, slots.size, dim)
        decoded = [self._codec.decode(coding, shape, self._dtype) for coding in (keys, values)]
        self._dense.load(slots, decoded[0], decoded[1])

    def _grow(self, slots: int) -> None:
        """Room for `slots`, grown by half at least (a block's own entries need room too)."""
        if slots > self._room:
            self._room = max(slots, self._room + self._room // 2)
            self._dense.reserve(self._room)


def new_working(ops: ArrayOps[A], layout: PackedLayout[A], keys: A, values: A, *, held: bool) -> WorkingResidents[A]:
    """The working form a generation begins with (`keys`, `values`: its first forward's, which show the backend's
    arrays): coordinates where the codec can be read so and `held` allows it, otherwise decoded."""
    if held and layout.codec.reads_held:
        one = np.zeros(1, dtype=np.int64)
        first = [(ops.take(keys, one), ops.take(values, one))]
        sample = layout.codec.code_blocks(first, layout.model_dtype)[0][2]  # shows the codings' arrays
        return HeldWorking(ops, layout.codec, sample, layout.model_dtype, layout.batch)
    shape = (layout.batch, layout.heads, layout.codec.spec.head_dim)
    return DecodedWorking(ops, layout.codec, layout.model_dtype, shape)
