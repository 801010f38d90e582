"""The codings a packed layer holds beside its packed codes: the stage's pieces, and committed entries not yet
bit-packed (packing is a fixed cost per call, so committed entries wait for `PACK_EVERY` of them)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Generic

import numpy as np

from kv_cache_proposer.cache.arrays import A, ArrayOps
from kv_cache_proposer.compression.codec import StagedCoding
from kv_cache_proposer.errors import InvariantViolation


class CodingLedger(Generic[A]):
    """Lattice codings on the backend, by stage slot (staged) or by resident slot (committed, not yet packed)."""

    def __init__(self, ops: ArrayOps[A]) -> None:
        self._ops = ops
        self.entry_bytes = 0  # bytes of one entry's coding (K and V coordinates, norms, scales), once known
        self._staged: list[tuple[int, StagedCoding[A]]] = []  # (first stage slot, coding) of each staged piece
        self._unpacked: list[tuple[np.ndarray, StagedCoding[A]]] = []  # committed, not yet packed: (slots, coding)
        self.unpacked_count = 0
        self.nbytes = 0  # bytes of the staged and unpacked codings, kept as a sum: read every step
        self.committed: list[A] = []  # the coding the last commit selected, until the cache settles it

    def staged_arrays(self) -> list[A]:
        return [array for _, coding in self._staged for array in coding.arrays()]

    def stage(self, slot: int, coding: StagedCoding[A]) -> None:
        """The coding of the stage entries from `slot` on."""
        self._staged.append((slot, coding))
        self.nbytes += self._bytes_of(coding)

    def forget_from(self, slot: int) -> None:
        """Forget the codings of stage slots from `slot` on: a forward writing there replaces them."""
        kept: list[tuple[int, StagedCoding[A]]] = []
        for start, coding in self._staged:
            self.nbytes -= self._bytes_of(coding)
            if start >= slot:
                continue
            if start + self._ops.length(coding.doubled) > slot:
                coding = select(coding, partial(self._ops.head, end=slot - start))
            kept.append((start, coding))
            self.nbytes += self._bytes_of(coding)
        self._staged = kept

    def drop_staged(self) -> None:
        self.nbytes -= sum(self._bytes_of(coding) for _, coding in self._staged)
        self._staged.clear()

    def staged_block(self, stage_offset: int, count: int) -> StagedCoding[A]:
        """The coding of stage slots `[stage_offset, stage_offset + count)`, from the pieces the forwards staged."""
        pieces = sorted(self._staged, key=lambda piece: piece[0])
        expected = stage_offset
        for start, coding in pieces:
            if start != expected:
                raise InvariantViolation("inv1", f"the stage holds codes from slot {start}, expected {expected}")
            expected += self._ops.length(coding.doubled)
        if expected - stage_offset < count:
            raise InvariantViolation("inv1", f"{count} entries committed but {expected - stage_offset} staged")
        return self._joined([coding for _, coding in pieces])

    def commit(self, slots: np.ndarray, coding: StagedCoding[A]) -> None:
        """Committed entries at resident `slots`, held as coordinates until the next `take_unpacked`."""
        self.committed = coding.arrays()
        self._unpacked.append((slots, coding))
        self.unpacked_count += int(slots.size)
        self.nbytes += self._bytes_of(coding)

    def take_unpacked(self) -> tuple[np.ndarray, StagedCoding[A]] | None:
        """Every committed entry not yet packed, as (slots, coding), and forget them (None: none)."""
        if not self._unpacked:
            return None
        slots = np.concatenate([slots for slots, _ in self._unpacked])
        codings = [coding for _, coding in self._unpacked]
        self.nbytes -= sum(self._bytes_of(c) for c in codings)
        self._unpacked.clear()
        self.unpacked_count = 0
        self.committed = []  # the caller reads them to the host, so nothing is left to settle
        return slots, self._joined(codings)

    def clear(self) -> None:
        self._staged.clear()
        self._unpacked.clear()
        self.unpacked_count = self.nbytes = 0
        self.committed = []

    def _joined(self, codings: list[StagedCoding[A]]) -> StagedCoding[A]:
        if len(codings) == 1:
            return codings[0]
        return StagedCoding(
            self._ops.concat([c.doubled for c in codings]),
            self._ops.concat([c.norms for c in codings]),
            self._ops.concat([c.qmax for c in codings]),
        )

    def _bytes_of(self, coding: StagedCoding[A]) -> int:
        return self.entry_bytes * self._ops.length(coding.doubled)


def select(coding: StagedCoding[A], pick: Callable[[A], A]) -> StagedCoding[A]:
    """The same entries of a coding's three arrays."""
    return StagedCoding(pick(coding.doubled), pick(coding.norms), pick(coding.qmax))
