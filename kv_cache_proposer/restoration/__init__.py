"""Restoring the K/V of evicted positions: restoration plans, f_θ projections and the `dlm_restore` session cache."""

from kv_cache_proposer.restoration.cache import RestoringSessionCache
from kv_cache_proposer.restoration.plan import PLAN_FILE, SOURCES, LayerSource, RestorationPlan, find_plan
from kv_cache_proposer.restoration.projection import LinearProjection, Rotary
from kv_cache_proposer.restoration.setup import REBUILD_MODES, RestorationSetup

__all__ = [
    "PLAN_FILE",
    "REBUILD_MODES",
    "SOURCES",
    "LayerSource",
    "LinearProjection",
    "RestorationPlan",
    "RestorationSetup",
    "RestoringSessionCache",
    "Rotary",
    "find_plan",
]
