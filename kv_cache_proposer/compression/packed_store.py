"""The packed layer store: committed K/V held as bit-packed KakeyaLattice codes plus fp16 scales.

Resident entries live on the host in a `PackedCodes` (codes, fp16 norms and scales, escapes), addressed by the
session cache's slots. The stage is dense, as for every store. While a session generates, its resident entries
are held unpacked on the backend with the stage (`working_residents`), so nothing packed is decoded per step: as
lattice coordinates that attention reads without decoding where it can (`HeldWorking`), otherwise decoded
(`DecodedWorking`). Held coordinates stand for the packed codes until the session parks: the codes are dropped when
the generation begins and packed again from the coordinates at `park`, so a generating layer holds one form of its
history, not two. A decoded copy is lossy to pack again from, so beside it the codes stay. `park` packs what is
left and drops the working form; `rest` keeps held coordinates as they are until the next generation (or a park,
or a fork, which reads codes). The store is lossy (see `layer_store`): a query
reads its own K/V as computed and every other position decoded. A one-token forward's entry is coded late, with
every layer's in one codec pass (`deferred_coding`); a longer forward codes its block at once, stages what the codes
decode to and appends the block as computed after the stage. Codings not yet packed are kept in a `CodingLedger`. See
docs/kv-compression.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic

import numpy as np

from kv_cache_proposer.cache.arrays import A, ArrayOps
from kv_cache_proposer.cache.layer_store import CommitPlan, LayerStore, StoreFootprint, joined_parts
from kv_cache_proposer.cache.protocol import KeyPart
from kv_cache_proposer.compression.codec import CodedBlock, LatticeCodec, StagedCoding
from kv_cache_proposer.compression.coding_ledger import CodingLedger, select
from kv_cache_proposer.compression.deferred_coding import BegunCoding, PendingEntry, finish_codings, start_codings
from kv_cache_proposer.compression.packed_codes import PackedCodes
from kv_cache_proposer.compression.working_residents import HeldWorking, PackedLayout, WorkingResidents, new_working

CodecFactory = Callable[[A], LatticeCodec[A]]
"""Builds the codec for a layer from its first K/V `[B, H, n, D]` (head dimension, device)."""

PACK_EVERY = 256
"""Committed entries a layer keeps as unpacked lattice coordinates (int16, on the backend) before packing them."""


class PackedLayerStore(Generic[A]):
    """`LayerStore` that holds resident K/V as packed KakeyaLattice codes."""

    lossy = True

    def __init__(self, ops: ArrayOps[A], codec_for: CodecFactory[A], *, held: bool = True) -> None:
        """`held`: hold the residents of a generating session coded where the codec can be read so (the
        verifier's attention reads `HeldKeys`); otherwise decoded in a working copy."""
        self._ops = ops
        self._codec_for = codec_for
        self._held_allowed = held
        self._layout: PackedLayout[A] | None = None
        self._packed: PackedCodes | None = None  # the resident entries, once the layer knows its shapes
        self._codings: CodingLedger[A] = CodingLedger(ops)  # codings not packed: staged, and committed since a pack
        self._work: WorkingResidents[A] | None = None  # the residents unpacked and the stage, while generating
        self._capacity = 0
        self._pending: PendingEntry[A] | None = None  # a one-token forward's entry, not coded yet
        self._begun: BegunCoding[A] | None = None  # the codec pass begun for it
        self._own = 0  # entries appended after the stage as computed: the last forward's queries (n > 1)
        self._unpacked_escapes = 0  # escaped blocks the packed codes held when they were dropped for held ones
        self._resting = False  # between generations, the held coordinates kept in place of the codes (`rest`)
        self.held = 0

    # -- what is held --------------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self._layout is not None

    @property
    def layout(self) -> PackedLayout[A] | None:
        """The codec, shapes and dtype (None until the layer holds K/V)."""
        return self._layout

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
        return self.packed_nbytes + self._codings.nbytes + self._working_nbytes()

    def working_nbytes(self, slots: int) -> int:
        """The unpacked residents and the stage, while generating, and the packed arrays' room beyond `slots`."""
        room = 0 if self._packed is None else self._packed.room_nbytes(slots)
        return self._working_nbytes() + room

    def _working_nbytes(self) -> int:
        return 0 if self._work is None else self._work.nbytes

    @property
    def codes_dropped(self) -> bool:
        """Whether the residents are held only as coordinates (a generating session's `HeldWorking`): the packed
        codes are made again from them at `park` (or by `pack`)."""
        return self._standing_in() is not None

    def _standing_in(self) -> HeldWorking[A] | None:
        """The held coordinates that stand for the dropped codes, while they do."""
        work = self._work
        return work if isinstance(work, HeldWorking) and work.stands_for_codes else None

    def footprint(self) -> StoreFootprint:
        if self._layout is None:
            return StoreFootprint(0, 0, 0)
        layout = self._layout
        dense = 2 * self.held * layout.rows * layout.codec.spec.head_dim * layout.itemsize
        if (held := self._standing_in()) is not None:
            # The coordinates are the compressed form held now; escapes are the ones counted at the last pack.
            return StoreFootprint(held.residents_nbytes, dense, self._unpacked_escapes)
        # Codings of entries committed since the last pack count as compressed bytes too (at most `PACK_EVERY`).
        compressed = self.packed_nbytes + self._codings.nbytes
        return StoreFootprint(compressed, dense, self._packed_of().escaped_blocks)

    def arrays(self) -> list[A]:
        # The codings of earlier commits were settled after those commits: listing them again would make every
        # step's settle grow with the entries not yet packed.
        working = [] if self._work is None else self._work.arrays()
        return working + self._codings.staged_arrays() + self._codings.committed

    # -- the session cache's calls -------------------------------------------------------------------------------
    def reserve(self, capacity: int) -> None:
        self._capacity = max(self._capacity, capacity)
        if self._work is not None:
            self._work.reserve(capacity)

    def stage(self, slot: int, keys: A, values: A) -> None:
        self._resting = False
        layout = self._start(keys)
        work = self._working(keys, values)
        if self._pending is not None and self._pending.slot >= slot:
            self._pending = self._begun = None  # this forward writes there again
        self._code_pending()  # an earlier forward's entry is read decoded from now on
        self._codings.forget_from(slot)
        count = self._ops.length(keys)
        if count == 1:
            work.stage(slot, keys, values)
            self._pending = PendingEntry(slot, keys, values)
            self._own = 0
            return
        decoded_keys, decoded_values, coding = layout.codec.code_blocks([(keys, values)], layout.model_dtype)[0]
        self._codings.stage(slot, coding)
        work.stage(slot, decoded_keys, decoded_values)
        work.stage(slot + count, keys, values)  # each query's own K/V, as computed
        self._own = count

    def stage_read(self) -> None:
        """A block's attention has read the stage (`ReadOnceStage`): a prefill chunk's dense copies, decoded and
        as computed, go now rather than at the commit, which needs only the block's coding. So a forward holds
        one layer's dense stage at a time, not every layer's."""
        if self._work is not None and self._own:
            self._work.stage_read()

    @classmethod
    def start_stages(cls, stores: Sequence[LayerStore[A]]) -> None:
        """Begin coding the pending one-token entries of every layer (`deferred_coding.start_codings`)."""
        start_codings([store for store in stores if isinstance(store, PackedLayerStore)])

    @classmethod
    def finish_stages(cls, stores: Sequence[LayerStore[A]]) -> None:
        """Stage the codings of every layer's pending one-token entry (`deferred_coding.finish_codings`)."""
        finish_codings([store for store in stores if isinstance(store, PackedLayerStore)])

    def read(self, stage_offset: int, end: int) -> tuple[A, A]:
        return joined_parts(self._ops, self.read_parts(stage_offset, end))

    def read_parts(self, stage_offset: int, end: int) -> list[KeyPart[A]]:
        if self._work is None:
            raise ValueError("the layer has no stage: no forward staged K/V since it parked")
        return self._work.read_parts(stage_offset, end + self._own)

    def commit(self, plan: CommitPlan) -> None:
        self._codings.committed = []
        work = self._work
        if work is None or plan.count == 0:
            self._drop_staged()
            return
        self._code_pending()
        self._own = 0
        coding = self._codings.staged_block(plan.stage_offset, plan.count)
        if plan.slots is None or plan.sources is None:
            slots = np.arange(plan.stage_offset, plan.stage_offset + plan.count, dtype=np.int64)
            if self._ops.length(coding.doubled) != plan.count:
                coding = select(coding, lambda array: self._ops.head(array, plan.count))
        else:
            slots, sources = plan.slots, plan.sources
            coding = select(coding, lambda array: self._ops.take(array, sources))
        work.commit(plan, slots, coding)
        self._drop_staged()
        if slots.size and not self.codes_dropped:  # held coordinates are packed at park, with every other resident
            self._codings.commit(slots, coding)
        if self._codings.unpacked_count >= PACK_EVERY:
            self.pack()
        self.held += plan.newly_held

    def gather(self, slots: np.ndarray) -> tuple[A, A]:
        if self._layout is None:
            raise ValueError("the layer holds no K/V")
        if self._work is not None:
            return self._work.gather(slots)
        return self._decode(0, slots), self._decode(1, slots)

    def load(self, slots: np.ndarray, keys: A, values: A) -> None:
        layout = self._start(keys)
        codings = [layout.codec.encode(array) for array in (keys, values)]
        if (held := self._standing_in()) is not None:
            held.load(slots, codings[0], codings[1])
            return
        self.pack()  # earlier commits to these slots must not overwrite the loaded entries later
        self._packed_of().write_vectors(slots, codings[0], codings[1])
        if self._work is not None:
            self._work.load(slots, codings[0], codings[1])

    def load_from(self, source: LayerStore[A], source_slots: np.ndarray, slots: np.ndarray) -> None:
        """Copy the packed codes of another packed layer (a forked session): decoding and encoding again would
        cost time and could change codes, since a decoded vector need not encode to the codes it came from."""
        if not isinstance(source, PackedLayerStore) or source.layout is None or source.packed is None:
            self.load(slots, *source.gather(source_slots))
            return
        source.pack()
        if self._layout is None:  # a layer of the same model: its codec, shapes and dtype
            self._layout = source.layout
            self._packed = PackedCodes(source.packed.spec, source.packed.rows)
            self._codings.entry_bytes = source.layout.entry_coding_bytes
        if (held := self._standing_in()) is not None:
            if slots.size:
                held.load(slots, source.packed.read(0, source_slots), source.packed.read(1, source_slots))
            return
        self.pack()
        self._packed_of().copy_from(source.packed, source_slots, slots)
        if self._work is not None and slots.size:
            self._work.load(slots, self._packed_of().read(0, slots), self._packed_of().read(1, slots))

    def park(self, slots: int) -> None:
        """Pack what is left, drop the unpacked residents and the stage and trim the packed arrays to the slots in
        use."""
        self.pack()
        self._drop_staged()
        self._work = None
        if self._packed is not None:
            self._packed.trim()

    def rest(self, slots: int) -> bool:
        """As `park`, but held coordinates that stand for the codes stay, trimmed to the slots in use: the next
        generation reads them as they are. They are packed when the session parks or when its codes are read (a
        fork copies codes)."""
        held = self._standing_in()
        if held is None:
            self.park(slots)
            return False
        self._drop_staged()
        held.trim(slots)
        if self._packed is not None:
            self._packed.trim()
        self._resting = True
        return True

    def release(self) -> None:
        self._resting = False
        self._work = None
        self._unpacked_escapes = 0
        self._codings.clear()
        if self._packed is not None:
            self._packed = PackedCodes(self._packed.spec, self._packed.rows)
        self._capacity = self._own = 0
        self._pending = self._begun = None
        self.held = 0

    def pack(self) -> None:
        """Bit-pack every committed entry still held as lattice coordinates, in one pass: the entries committed
        since the last pack, or, while the codes are dropped, every resident (the codes are then held again)."""
        codec = self._layout_of().codec
        if (held := self._standing_in()) is not None:
            slots = held.resident_slots()
            self._packed_of().write_staged(slots, *codec.to_host(held.take(slots)))
            held.stands_for_codes = False
            if self._resting:  # between generations the codes are the one form to hold
                self._work = None
                self._resting = False
            return
        taken = self._codings.take_unpacked()
        if taken is not None:
            slots, coding = taken
            self._packed_of().write_staged(slots, *codec.to_host(coding))

    # -- the deferred coding of a one-token forward's entry (`deferred_coding.DeferredCoder`) ------------------------
    @property
    def pending(self) -> PendingEntry[A] | None:
        return self._pending

    def coding_key(self) -> tuple[Any, ...]:
        layout, entry = self._layout_of(), self._pending
        assert entry is not None
        return (layout.codec.spec, layout.model_dtype, tuple(entry.keys.shape))  # type: ignore[attr-defined]

    @property
    def reads_held(self) -> bool:
        """Whether a generating session holds the layer's residents as coordinates that attention reads."""
        return self._held_allowed and self._layout is not None and self._layout.codec.reads_held

    def held_coding(self, slots: np.ndarray) -> StagedCoding[A] | None:
        """The coding of resident `slots` as the coordinates a generating session holds (None: not held so)."""
        return self._work.take(slots) if isinstance(self._work, HeldWorking) else None

    def codec(self) -> tuple[LatticeCodec[A], Any]:
        layout = self._layout_of()
        return layout.codec, layout.model_dtype

    def begin(self, result: Callable[[], list[CodedBlock[A]]], index: int) -> None:
        assert self._pending is not None
        self._begun = BegunCoding(self._pending, result, index)

    def begun(self) -> bool:
        return self._begun is not None and self._begun.entry is self._pending

    def take_coding(self, block: CodedBlock[A] | None = None) -> None:
        """Stage the decoded K/V and the coding of the pending entry in place of its computed K/V."""
        begun, self._begun = self._begun, None
        if block is None:
            assert begun is not None
            block = begun.result()[begun.index]
        entry = self._pending
        assert entry is not None
        self._pending = None
        keys, values, coding = block
        assert self._work is not None  # a pending entry was staged in it
        self._work.stage(entry.slot, keys, values)
        self._codings.stage(entry.slot, coding)

    # -- internals -------------------------------------------------------------------------------------------------
    def _start(self, like: A) -> PackedLayout[A]:
        """The layout, learnt from the layer's first K/V `[B, H, n, D]`."""
        if self._layout is not None:
            return self._layout
        shape: Any = like.shape  # type: ignore[attr-defined]
        batch, heads, count, dim = (int(s) for s in shape)
        codec = self._codec_for(like)
        itemsize = self._ops.nbytes(like) // max(1, batch * heads * count * dim)
        self._layout = PackedLayout(codec, batch, heads, itemsize, self._ops.dtype(like))
        self._packed = PackedCodes(codec.spec, batch * heads)
        self._codings.entry_bytes = self._layout.entry_coding_bytes
        return self._layout

    def _code_pending(self) -> None:
        """Code a one-token forward's entry now (taking the pass begun for it, if any)."""
        if self._pending is None:
            self._begun = None
        elif self.begun():
            self.take_coding()
        else:
            layout = self._layout_of()
            entry = self._pending
            self.take_coding(layout.codec.code_blocks([(entry.keys, entry.values)], layout.model_dtype)[0])

    def _working(self, keys: A, values: A) -> WorkingResidents[A]:
        """The unpacked residents and the stage, made once per generation (`keys`, `values`: the forward's, which
        show the backend's arrays): held as coordinates where the codec can be read so and the store may
        (`held`), otherwise decoded."""
        if self._work is not None:
            return self._work
        work = new_working(self._ops, self._layout_of(), keys, values, held=self._held_allowed)
        work.reserve(self._capacity)
        self.pack()
        packed = self._packed_of()
        slots = np.flatnonzero(packed.occupied())
        if slots.size:
            work.load(slots, packed.read(0, slots), packed.read(1, slots))
        self._work = work
        if isinstance(work, HeldWorking):  # the coordinates stand for the codes until park packs them again
            self._unpacked_escapes = packed.escaped_blocks
            self._packed = PackedCodes(packed.spec, packed.rows)
            work.stands_for_codes = True
        return work

    def _drop_staged(self) -> None:
        self._codings.drop_staged()
        self._pending = self._begun = None
        self._own = 0
        if self._work is not None:
            self._work.drop_stage()

    def _layout_of(self) -> PackedLayout[A]:
        if self._layout is None:
            raise ValueError("the layer holds no K/V")
        return self._layout

    def _packed_of(self) -> PackedCodes:
        if self._packed is None:
            raise ValueError("the layer holds no K/V")
        return self._packed

    def _decode(self, tensor: int, slots: np.ndarray) -> A:
        """Dense `[B, H, len(slots), D]` of the packed entries of `slots`, in the model's dtype."""
        layout = self._layout_of()
        coding = self._packed_of().read(tensor, slots)
        return layout.codec.decode(coding, layout.shape(slots.size), layout.model_dtype)
