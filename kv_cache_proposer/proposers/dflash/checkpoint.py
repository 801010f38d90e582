"""DFlash drafter checkpoints: `config.json` (a Qwen3 config plus the DFlash fields) and safetensors weights.

Fields read: `block_size` and `num_target_layers` (top level), `dflash_config.target_layer_ids` and
`dflash_config.mask_token_id` (either may also sit at the top level), and the optional `input_embedding_scale`,
`output_multiplier` and `final_logit_softcapping`. Writing uses the canonical placement.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from kv_cache_proposer.errors import ModelLoadError
from kv_cache_proposer.proposers.dflash.model import DFlashDrafter


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


def read_config(directory: str | Path) -> tuple[Qwen3Config, DFlashSpec]:
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
    return Qwen3Config.from_dict(raw), spec


def load_drafter(
    directory: str | Path, *, device: torch.device, dtype: torch.dtype
) -> tuple[DFlashDrafter, DFlashSpec]:
    """Build the drafter from `directory` and load its weights (every parameter must be present)."""
    path = Path(directory)
    config, spec = read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} holds no weights (*.safetensors)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    drafter = DFlashDrafter(config, len(spec.target_layer_ids))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelLoadError(
            f"{path}: weights do not match the DFlash format (missing: {sorted(missing)[:5]}, "
            f"unexpected: {sorted(unexpected)[:5]})"
        )
    drafter.to(device=device, dtype=dtype)
    drafter.eval()
    return drafter, spec


def save_drafter(drafter: DFlashDrafter, spec: DFlashSpec, directory: str | Path) -> None:
    """Write `directory/config.json` and `directory/model.safetensors` in the published format."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    raw = drafter.config.to_dict()
    for name in ("dflash_config", "target_layer_ids", "mask_token_id", "block_size", "num_target_layers"):
        raw.pop(name, None)
    raw.update(
        architectures=["DFlashDraftModel"],
        block_size=spec.block_size,
        num_target_layers=spec.num_target_layers,
        dflash_config={"target_layer_ids": list(spec.target_layer_ids), "mask_token_id": spec.mask_token_id},
    )
    if spec.input_embedding_scale != 1.0:
        raw["input_embedding_scale"] = spec.input_embedding_scale
    (path / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    weights = {name: tensor.detach().contiguous().cpu() for name, tensor in drafter.state_dict().items()}
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
