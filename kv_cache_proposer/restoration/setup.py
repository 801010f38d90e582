"""How `dlm_restore` sessions restore evicted K/V: the plan, and when restored K/V are rebuilt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kv_cache_proposer.cache.layer_store import LayerStoreFactory
from kv_cache_proposer.restoration.plan import RestorationPlan

# Evicted positions a rebuild of a coded prefix restores at a time: the most it holds dense at once.
REBUILD_RUN = 1024

RebuildMode = Literal["generation", "step"]
REBUILD_MODES: tuple[RebuildMode, ...] = ("generation", "step")


@dataclass(frozen=True, slots=True)
class RestorationSetup:
    """How `dlm_restore` sessions restore evicted K/V: the plan (None: `recompute` for every layer, the exact
    reference) and when restored K/V are rebuilt."""

    plan: RestorationPlan | None = None
    rebuild: RebuildMode = "generation"
    # What holds the K/V of kept layers when the session has no compressor of its own (None: dense, in the
    # model's dtype): the plan's `kept_compressor`, built for the serving backend.
    kept_store: LayerStoreFactory[Any] | None = None
    # The most prefix tokens one `recompute` forward reads: the rebuild runs over the prefix in chunks of this size
    # (0: the model's own prefill chunk, `prefill_chunk_tokens`).
    chunk_tokens: int = 0

    def __post_init__(self) -> None:
        if self.rebuild not in REBUILD_MODES:
            raise ValueError(f"rebuild must be one of {', '.join(REBUILD_MODES)}, got {self.rebuild!r}")
        if self.chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0, got {self.chunk_tokens}")

    def plan_for(self, num_layers: int) -> RestorationPlan:
        """The plan for a model of `num_layers` layers; raises `ValueError` when the plan does not fit it."""
        if self.plan is None:
            return RestorationPlan.uniform(num_layers, "recompute")
        self.plan.check_model(num_layers)
        return self.plan
