"""The daemon's side of `dlm_restore`: which restoration plan its sessions use, and what a session reports of it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from inference_engine.config import ConfigError, ServerConfig
from kv_cache_proposer.restoration import RestorationPlan, RestorationSetup
from kv_cache_proposer.verifier import SessionCache

log = logging.getLogger(__name__)


def restoration_setup(config: ServerConfig, num_layers: int, shipped: Path | None) -> RestorationSetup:
    """The plan of `--restore-plan` (`recompute`: every layer recomputed), else the plan the model directory ships
    (`shipped`), else `recompute` for every layer; raises `ConfigError` when the plan cannot be read or does not
    fit the model."""
    path = None if config.restore_plan == "recompute" else config.restore_plan or shipped
    try:
        plan = RestorationPlan.load(path) if path else None
        setup = RestorationSetup(plan, rebuild=config.restore_rebuild)  # type: ignore[arg-type]
        setup.plan_for(num_layers)
    except ValueError as exc:
        if config.restore_plan or config.kv_strategy == "dlm_restore":
            raise ConfigError(f"restore_plan: {exc}") from None
        # A plan shipped for another model is not this server's concern unless it serves dlm_restore by default;
        # sessions that ask for dlm_restore then recompute every layer (exact), and the log says why.
        log.warning("ignoring the model directory's restoration plan", extra={"reason": str(exc)})
        return RestorationSetup(rebuild=config.restore_rebuild)  # type: ignore[arg-type]
    return setup


def restoration_info(cache: SessionCache[Any]) -> dict[str, int]:
    """The `SessionInfo` fields of a session's restoration: restored positions and the bytes by kind."""
    restoration_bytes = cache.restoration_state_bytes + cache.restored_bytes
    return {
        "restored_token_count": int(cache.restored_count),
        "kv_resident_bytes": int(cache.nbytes) - restoration_bytes,
        "kv_restored_bytes": int(cache.restored_bytes),
        "kv_restoration_state_bytes": int(cache.restoration_state_bytes),
        "kv_peak_restored_bytes": int(cache.peak_restored_bytes),
    }
