"""KV strategies: which history positions stay resident in a session's verifier cache, and what each query sees.

Positions are global: a key keeps the rotary position it was computed at, and eviction never re-indexes the
positions of what stays resident. The result of every forward therefore equals full attention over the whole
sequence with the strategy's visibility mask, whatever the chunking of the forwards.

Strategies are built by name in one place, `make_strategy`; `STRATEGIES` lists the names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class KVStrategy(Protocol):
    """A resident-set policy. Slots are the cache's storage indices; positions are global history positions."""

    @property
    def name(self) -> str: ...

    @property
    def bounded_slots(self) -> int | None:
        """Number of resident slots when bounded, None when the cache grows with the history."""
        ...

    def slot_of(self, position: int) -> int:
        """Storage slot of a committed position."""
        ...

    def slots_of(self, positions: np.ndarray) -> np.ndarray:
        """Storage slots of committed positions (elementwise `slot_of`)."""
        ...

    def resident_count(self, committed: int) -> int:
        """Positions resident once `committed` positions have been committed."""
        ...

    def resident_positions(self, committed: int) -> np.ndarray:
        """The positions resident once `committed` positions have been committed, ascending."""
        ...

    def visible(self, query_pos: Any, key_pos: Any) -> Any:
        """Boolean array: whether a query at `query_pos` may attend a key at `key_pos` (broadcasting; causality
        is applied separately)."""
        ...


@dataclass(frozen=True, slots=True)
class FullStrategy:
    """Every position stays resident (the reference; memory grows with the history)."""

    @property
    def name(self) -> str:
        return "full"

    @property
    def bounded_slots(self) -> int | None:
        return None

    def slot_of(self, position: int) -> int:
        return position

    def slots_of(self, positions: np.ndarray) -> np.ndarray:
        return positions

    def resident_count(self, committed: int) -> int:
        return committed

    def resident_positions(self, committed: int) -> np.ndarray:
        return np.arange(committed, dtype=np.int64)

    def visible(self, query_pos: Any, key_pos: Any) -> Any:
        return key_pos >= 0


@dataclass(frozen=True, slots=True)
class SinkWindowStrategy:
    """The first `sink` positions and the last `window` positions stay resident.

    A query at position q attends keys at positions `< sink` and keys in `[q - window, q]`: the `window` positions
    before it plus itself. Keys older than that are evicted after the forward that made them unnecessary.
    """

    sink: int
    window: int

    def __post_init__(self) -> None:
        if self.sink < 0:
            raise ValueError(f"sink must be >= 0, got {self.sink}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    @property
    def name(self) -> str:
        return "sink_window"

    @property
    def bounded_slots(self) -> int | None:
        return self.sink + self.window

    def slot_of(self, position: int) -> int:
        if position < self.sink:
            return position
        return self.sink + (position - self.sink) % self.window

    def slots_of(self, positions: np.ndarray) -> np.ndarray:
        ring = self.sink + (positions - self.sink) % self.window
        return np.where(positions < self.sink, positions, ring)

    def resident_count(self, committed: int) -> int:
        return min(committed, self.sink + self.window)

    def resident_positions(self, committed: int) -> np.ndarray:
        sink = np.arange(min(committed, self.sink), dtype=np.int64)
        window = np.arange(max(self.sink, committed - self.window), committed, dtype=np.int64)
        return np.concatenate([sink, window])

    def visible(self, query_pos: Any, key_pos: Any) -> Any:
        return (key_pos < self.sink) | (query_pos - key_pos <= self.window)


@dataclass(frozen=True, slots=True)
class DlmRestoreStrategy:
    """The sink and window of `sink_window` stay resident; every evicted position is restored for each forward.

    Residency (slots, eviction) is exactly `sink_window`'s. Visibility is not: a query reads every earlier key,
    because the session cache puts restored K/V of the evicted positions in front of the resident ones (see
    `kv_cache_proposer.restoration`), so nothing leaves the attention span.
    """

    sink: int
    window: int

    def __post_init__(self) -> None:
        SinkWindowStrategy(sink=self.sink, window=self.window)  # raises on a bad sink or window

    @property
    def resident(self) -> SinkWindowStrategy:
        """The resident-set policy (sink + window ring)."""
        return SinkWindowStrategy(sink=self.sink, window=self.window)

    @property
    def name(self) -> str:
        return "dlm_restore"

    @property
    def bounded_slots(self) -> int | None:
        return self.sink + self.window

    def slot_of(self, position: int) -> int:
        return self.resident.slot_of(position)

    def slots_of(self, positions: np.ndarray) -> np.ndarray:
        return self.resident.slots_of(positions)

    def resident_count(self, committed: int) -> int:
        return self.resident.resident_count(committed)

    def resident_positions(self, committed: int) -> np.ndarray:
        return self.resident.resident_positions(committed)

    def evicted_positions(self, committed: int) -> np.ndarray:
        """The positions restored once `committed` positions have been committed, ascending."""
        return np.arange(self.sink, max(self.sink, committed - self.window), dtype=np.int64)

    def visible(self, query_pos: Any, key_pos: Any) -> Any:
        return key_pos >= 0


STRATEGIES = ("full", "sink_window", "dlm_restore")


def make_strategy(name: str, *, sink: int | None = None, window: int | None = None) -> KVStrategy:
    """Build a strategy from its name and options (options a strategy does not take are ignored).

    `sink_window` and `dlm_restore` take `sink` (default 4) and `window` (default 1024). Raises `ValueError`
    naming what is wrong.
    """
    if name == "full":
        return FullStrategy()
    if name == "sink_window":
        return SinkWindowStrategy(sink=4 if sink is None else sink, window=1024 if window is None else window)
    if name == "dlm_restore":
        return DlmRestoreStrategy(sink=4 if sink is None else sink, window=1024 if window is None else window)
    raise ValueError(f"unknown KV strategy {name!r}; expected one of {', '.join(STRATEGIES)}")


def strategy_options(strategy: KVStrategy) -> dict[str, int]:
    """The options `make_strategy` needs to rebuild `strategy` (empty for `full`)."""
    if isinstance(strategy, SinkWindowStrategy | DlmRestoreStrategy):
        return {"sink": strategy.sink, "window": strategy.window}
    return {}
