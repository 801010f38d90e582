"""A session cache's slot table: the global position held in every slot (−1: none), resident slots first, then the
stage of the forward in flight, and where a commit writes the staged positions a strategy keeps."""

from __future__ import annotations

import numpy as np

from kv_cache_proposer.cache.layer_store import CommitPlan
from kv_cache_proposer.strategies import KVStrategy


class SlotTable:
    """Positions by slot, `[capacity]` int64. An unbounded strategy's slots are its positions in order; a bounded
    one maps positions to slots (`KVStrategy.slots_of`), so a commit can overwrite an evicted position's slot."""

    def __init__(self) -> None:
        self.positions = np.full(0, -1, dtype=np.int64)  # [capacity]
        self._steps = np.arange(0, dtype=np.int64)  # 0, 1, 2, ...: block positions relative to the block start

    @property
    def capacity(self) -> int:
        return int(self.positions.size)

    @property
    def nbytes(self) -> int:
        return int(self.positions.nbytes)

    def grow(self, capacity: int) -> None:
        """Room for `capacity` slots, the new ones empty."""
        positions = np.full(capacity, -1, dtype=np.int64)
        positions[: self.capacity] = self.positions
        self.positions = positions

    def shrink(self, used: int) -> None:
        """Keep room for the first `used` slots only (a parked cache's)."""
        if self.capacity > used:
            self.positions = self.positions[:used].copy()

    def stage(self, start: int, first_position: int, count: int) -> None:
        """Slots `[start, start + count)` hold positions `first_position, first_position + 1, ...`."""
        np.add(self._block_steps(count), first_position, out=self.positions[start : start + count])

    def resident_slots(self, stage_offset: int) -> np.ndarray:
        """Occupied slots before `stage_offset`, ordered by the positions they hold."""
        positions = self.positions[:stage_offset]
        slots = np.flatnonzero(positions >= 0)
        return slots[np.argsort(positions[slots], kind="stable")]

    def occupied(self, stage_offset: int) -> int:
        """Slots before `stage_offset` that hold a position."""
        return int((self.positions[:stage_offset] >= 0).sum())

    def commit_plan(self, strategy: KVStrategy, stage_offset: int, next_position: int, count: int) -> CommitPlan:
        """Where committing the first `count` staged positions (the first is `next_position`) writes them."""
        if strategy.bounded_slots is None:
            return CommitPlan(stage_offset, count, None, None, count)
        targets = strategy.slots_of(self._block_steps(count) + next_position)  # [count]
        # A later position wins a slot that an earlier one of the same commit also maps to.
        reversed_unique, first_from_end = np.unique(targets[::-1], return_index=True)
        sources = (count - 1 - first_from_end).astype(np.int64)
        newly_held = int((self.positions[reversed_unique] < 0).sum())
        return CommitPlan(
            stage_offset, count, reversed_unique.astype(np.int64), sources, newly_held, sources + stage_offset
        )

    def release(self) -> None:
        self.positions = np.full(0, -1, dtype=np.int64)

    def _block_steps(self, count: int) -> np.ndarray:
        """0, 1, ..., count − 1 (a view of one table kept for every block)."""
        if count > self._steps.size:
            self._steps = np.arange(max(count, 2 * self._steps.size), dtype=np.int64)
        return self._steps[:count]
