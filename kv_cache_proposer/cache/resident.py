"""What a session cache holds, apart from the forward in flight: the slot table and one `LayerStore` per layer, the
counters, INV-1, and the whole resident state read, loaded and copied (what journals, forks and restoration use).
`KVSessionCache` adds the stage, the model call and the commit."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Generic

import numpy as np

from kv_cache_proposer.cache.arrays import A, ArrayOps
from kv_cache_proposer.cache.layer_store import DenseLayerStore, LayerStore, LayerStoreFactory
from kv_cache_proposer.cache.slot_table import SlotTable
from kv_cache_proposer.errors import InvariantViolation
from kv_cache_proposer.strategies import KVStrategy, strategy_options


class ResidentCache(Generic[A]):
    """The resident part of a session cache: slots, layers and their whole state."""

    def __init__(
        self,
        strategy: KVStrategy,
        *,
        num_layers: int,
        ops: ArrayOps[A],
        layer_store: LayerStoreFactory[A] | None = None,
    ) -> None:
        factory: LayerStoreFactory[A] = layer_store or DenseLayerStore
        self._strategy = strategy
        self._ops = ops
        self._layer_store = factory
        self._layers: list[LayerStore[A]] = [factory(ops) for _ in range(num_layers)]
        self._next_position = 0
        self._slots = SlotTable()  # resident slots' positions, then the stage's
        self._staged = 0  # positions in the stage

    # -- counters ----------------------------------------------------------------------------------------------
    @property
    def strategy(self) -> KVStrategy:
        return self._strategy

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def ops(self) -> ArrayOps[A]:
        """The backend's array operations on this cache's K/V."""
        return self._ops

    @property
    def next_position(self) -> int:
        return self._next_position

    @property
    def resident_count(self) -> int:
        return self._strategy.resident_count(self._next_position)

    @property
    def evicted_count(self) -> int:
        return self._next_position - self.resident_count

    @property
    def nbytes(self) -> int:
        return self._slots.nbytes + sum(layer.nbytes for layer in self._layers)

    @property
    def stage_offset(self) -> int:
        """First slot of the stage; slots before it are resident."""
        bounded = self._strategy.bounded_slots
        return self._next_position if bounded is None else bounded

    def check_invariants(self) -> None:
        """INV-1: every layer that stores K/V holds exactly the strategy's resident count, as does the slot table."""
        expected = self.resident_count
        for layer_idx, layer in enumerate(self._layers):
            if layer.active and layer.held != expected:
                raise InvariantViolation(
                    "inv1", f"layer {layer_idx} holds {layer.held} K/V but {expected} positions are resident"
                )
        occupied = self._slots.occupied(self.stage_offset)
        if occupied != expected:
            raise InvariantViolation("inv1", f"slot table holds {occupied} positions, expected {expected}")

    def _grow(self, capacity: int) -> None:
        self._slots.grow(capacity)
        for layer in self._layers:
            layer.reserve(capacity)

    def arrays(self) -> list[A]:
        return [array for layer in self._layers for array in layer.arrays()]

    # -- the resident state -------------------------------------------------------------------------------------
    def _resident_slots(self) -> np.ndarray:
        """Occupied resident slots ordered by position."""
        return self._slots.resident_slots(self.stage_offset)

    def resident_kv(self, layer_idx: int) -> tuple[A, A, np.ndarray]:
        layer = self._layers[layer_idx]
        if not layer.active:
            raise ValueError(f"layer {layer_idx} holds no K/V")
        slots = self._resident_slots()
        keys, values = layer.gather(slots)
        return keys, values, self._slots.positions[slots].copy()

    def positions_kv(self, layer_idx: int, positions: np.ndarray) -> tuple[A, A]:
        """Keys and values `[B, H, n, D]` of resident `positions` of one layer, in that order (dense copies)."""
        slots = self._strategy.slots_of(positions)
        held = self._slots.positions[: self.stage_offset]
        if slots.size and (int(slots.max()) >= held.size or not np.array_equal(held[slots], positions)):
            raise ValueError(f"positions {positions[:5].tolist()}... are not all resident")
        layer = self._layers[layer_idx]
        if not layer.active:
            raise ValueError(f"layer {layer_idx} holds no K/V")
        return layer.gather(slots)

    def load_resident(self, state: Sequence[tuple[A, A]], positions: np.ndarray) -> None:
        """An empty cache takes `state` (every layer's K/V `[B, H, n, D]` of `positions`, in order) as what it
        holds after committing positions `[0, positions[-1] + 1)`; `positions` are those the strategy keeps."""
        if self._next_position or self._staged:
            raise ValueError("only an empty cache loads resident K/V")
        next_position = int(positions[-1]) + 1 if positions.size else 0
        if not np.array_equal(positions, self._strategy.resident_positions(next_position)):
            raise ValueError(f"the {self._strategy.name} strategy does not keep exactly these positions")
        self._restore(state, positions, next_position)

    @property
    def state(self) -> list[tuple[A, A] | None]:
        """Resident K/V of every layer in position order (None for a layer that holds none)."""
        slots = self._resident_slots()
        return [layer.gather(slots) if layer.active else None for layer in self._layers]

    @property
    def meta_state(self) -> dict[str, Any]:
        """What `state` needs to be rebuilt: the strategy, the next position and the resident positions."""
        return {
            "strategy": self._strategy.name,
            **strategy_options(self._strategy),
            "next_position": self._next_position,
            "positions": self._slots.positions[self._resident_slots()].tolist(),
        }

    def _restore(self, state: Sequence[tuple[A, A] | None], positions: np.ndarray, next_position: int) -> None:
        loads = [
            None if kv is None else partial(_load_state, layer, kv)
            for layer, kv in zip(self._layers, state, strict=True)
        ]
        self._fill(loads, positions, next_position)

    def _fill(
        self, loads: Sequence[Callable[[np.ndarray], None] | None], positions: np.ndarray, next_position: int
    ) -> None:
        """Hold `positions` as resident, each layer's entries written by its `loads` callable (given the slots)."""
        self._next_position = next_position
        if positions.size != self.resident_count:
            raise ValueError(f"{positions.size} resident positions given, the strategy keeps {self.resident_count}")
        slots = self._strategy.slots_of(positions)
        self._grow(max(self.stage_offset, 1))
        self._slots.positions[slots] = positions
        for layer, load in zip(self._layers, loads, strict=True):
            if load is not None:
                load(slots)
                layer.held = positions.size
        self._ops.settle(self.arrays())
        self.check_invariants()


def _load_state(layer: LayerStore[A], kv: tuple[A, A], slots: np.ndarray) -> None:
    layer.load(slots, *kv)
