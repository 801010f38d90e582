"""The daemon's side of `dlm_restore`: which restoration plan its sessions use, and what a session reports of it."""

from __future__ import annotations

from pathlib import Path

from inference_engine.config import ConfigError, ServerConfig
from kv_cache_proposer.cache.protocol import CacheFootprint
from kv_cache_proposer.compression import KVCompressor, compressor_layer_store
from kv_cache_proposer.restoration import RestorationPlan, RestorationSetup


def restoration_setup(config: ServerConfig, num_layers: int, shipped: Path | None) -> RestorationSetup:
    """The plan of `--restore-plan` (`recompute`: every layer recomputed), else the plan the model directory ships
    (`shipped`), else `recompute` for every layer.

    Raises `ConfigError` when the plan cannot be read or does not fit the model, whichever strategy the server
    serves by default: any session may ask for `dlm_restore`, and it must not get another plan than the one the
    operator shipped or named."""
    named = Path(config.restore_plan) if config.restore_plan else shipped
    path = None if config.restore_plan == "recompute" else named
    try:
        plan = RestorationPlan.load(path) if path else None
        kept = KVCompressor.parse(plan.kept_compressor) if plan else KVCompressor()
        kept_store = compressor_layer_store(config.backend, kept)
        setup = RestorationSetup(
            plan,
            rebuild=config.restore_rebuild,  # type: ignore[arg-type]
            kept_store=kept_store,
            # A rebuild forward reads no more than a prefill forward (0: the model's own prefill chunk).
            chunk_tokens=config.prefill_chunk_tokens,
        )
        setup.plan_for(num_layers)
    except ValueError as exc:
        origin = "--restore-plan" if config.restore_plan else "the model directory's restoration plan"
        raise ConfigError(
            f"restore_plan: cannot use {origin} {path}: {exc}. Serve without it "
            "(--restore-plan recompute: every evicted layer recomputed, exact) or make a plan for this model "
            "with scripts/plan_restore.py --model <model directory>"
        ) from None
    return setup


def restoration_info(footprint: CacheFootprint) -> dict[str, int]:
    """The `SessionInfo` fields of a session's restoration: restored positions and the bytes by kind."""
    restoration_bytes = footprint.restoration_state_bytes + footprint.history_token_bytes + footprint.restored_bytes
    return {
        "restored_token_count": footprint.restored_count,
        "kv_resident_bytes": footprint.nbytes - restoration_bytes,
        "kv_restored_bytes": footprint.restored_bytes,
        "kv_restoration_state_bytes": footprint.restoration_state_bytes,
        "kv_peak_restored_bytes": footprint.peak_restored_bytes,
        "history_token_bytes": footprint.history_token_bytes,
    }
