"""The DFlash checkpoint config: a Qwen3 config plus the DFlash fields, and the checks against a verifier.

Fields read: `block_size` and `num_target_layers` (top level), `dflash_config.target_layer_ids` and
`dflash_config.mask_token_id` (either may also sit at the top level), and the optional `input_embedding_scale`,
`output_multiplier` and `final_logit_softcapping`. No framework is imported here: both backends share it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kv_cache_proposer.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class DFlashSpec:
    """The DFlash-specific part of a drafter config."""

    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ModelLoadError(f"DFlash block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ModelLoadError("DFlash dflash_config.target_layer_ids is empty")


def _field(raw: dict[str, Any], name: str, default: Any = None) -> Any:
    nested = raw.get("dflash_config") or {}
    return nested.get(name, raw.get(name, default))


def read_config(directory: str | Path) -> tuple[dict[str, Any], DFlashSpec]:
    """The raw config (Qwen3 fields and all) and the DFlash fields of a drafter directory."""
    path = Path(directory)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} is not a DFlash drafter directory: config.json is missing")
    raw = json.loads(config_file.read_text())
    architectures = " ".join(raw.get("architectures") or [])
    if "DFlash2" in architectures or _field(raw, "selector_rank") is not None:
        raise ModelLoadError(f"{path}: DFlash2 drafters (convolutions, candidate selector) are not supported")
    target_layer_ids = _field(raw, "target_layer_ids")
    mask_token_id = _field(raw, "mask_token_id")
    if target_layer_ids is None or mask_token_id is None:
        raise ModelLoadError(f"{path}: config.json lacks dflash_config.target_layer_ids or mask_token_id")
    softcap = _field(raw, "final_logit_softcapping")
    spec = DFlashSpec(
        block_size=int(_field(raw, "block_size", 16)),
        target_layer_ids=tuple(int(i) for i in target_layer_ids),
        mask_token_id=int(mask_token_id),
        num_target_layers=None if raw.get("num_target_layers") is None else int(raw["num_target_layers"]),
        input_embedding_scale=float(_field(raw, "input_embedding_scale", 1.0)),
        output_multiplier=float(_field(raw, "output_multiplier", 1.0)),
        final_logit_softcapping=None if softcap is None else float(softcap),
    )
    return raw, spec


def check_compatible(
    spec: DFlashSpec, drafter_hidden_size: int, *, hidden_size: int, num_layers: int, vocab_size: int
) -> None:
    """Refuse a drafter built for another verifier (hidden size, layer count, target layers, mask token)."""
    if drafter_hidden_size != hidden_size:
        raise ModelLoadError(
            f"the drafter's hidden size {drafter_hidden_size} differs from the verifier's {hidden_size}"
        )
    if max(spec.target_layer_ids) >= num_layers or min(spec.target_layer_ids) < 0:
        raise ModelLoadError(
            f"target_layer_ids {list(spec.target_layer_ids)} do not fit a verifier of {num_layers} layers"
        )
    if spec.num_target_layers is not None and spec.num_target_layers != num_layers:
        raise ModelLoadError(
            f"the drafter was built for a verifier of {spec.num_target_layers} layers, this one has {num_layers}"
        )
    if not 0 <= spec.mask_token_id < vocab_size:
        raise ModelLoadError(f"mask_token_id {spec.mask_token_id} is outside the verifier vocabulary")


def layer_windows(raw: dict[str, Any]) -> list[int | None]:
    """Per drafter layer: its sliding window (`layer_types` / `sliding_window`), or None for full attention."""
    types = raw.get("layer_types") or ["full_attention"] * raw["num_hidden_layers"]
    window = raw.get("sliding_window")
    return [int(window) if t == "sliding_attention" and window else None for t in types]
