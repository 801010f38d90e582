"""Slot bookkeeping shared by the backends' session caches: positions, where a commit writes, and INV-1."""

from __future__ import annotations

from collections.abc import Sequence

from kv_cache_proposer.errors import InvariantViolation
from kv_cache_proposer.strategies import KVStrategy


class PositionBookkeeping:
    """The position counters of a session cache, derived from its strategy and its next position."""

    _strategy: KVStrategy
    _next_position: int

    @property
    def strategy(self) -> KVStrategy:
        return self._strategy

    @property
    def next_position(self) -> int:
        return self._next_position

    @property
    def resident_count(self) -> int:
        return self._strategy.resident_count(self._next_position)

    @property
    def evicted_count(self) -> int:
        return self._next_position - self.resident_count


def commit_targets(strategy: KVStrategy, start: int, count: int) -> tuple[list[int], list[int]]:
    """(slot, stage index) pairs for committing positions [start, start + count); later positions win a slot."""
    targets: dict[int, int] = {}
    for i in range(count):
        targets[strategy.slot_of(start + i)] = i
    return list(targets), list(targets.values())


def check_resident(held: Sequence[int | None], occupied: int, expected: int) -> None:
    """INV-1: every layer that stores K/V (`held[i]` not None) holds exactly `expected` entries, as does the slot
    table (`occupied`)."""
    for layer_idx, count in enumerate(held):
        if count is not None and count != expected:
            raise InvariantViolation(
                "inv1", f"layer {layer_idx} holds {count} K/V but {expected} positions are resident"
            )
    if occupied != expected:
        raise InvariantViolation("inv1", f"slot table holds {occupied} positions, expected {expected}")
