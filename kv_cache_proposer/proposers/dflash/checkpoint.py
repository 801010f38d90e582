"""DFlash drafter checkpoints on PyTorch: loading and writing `config.json` + safetensors weights.

Writing uses the canonical placement of the DFlash fields (see `config.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from kv_cache_proposer.errors import ModelLoadError
from kv_cache_proposer.proposers.dflash.config import DFlashSpec, layer_windows, read_config
from kv_cache_proposer.proposers.dflash.model import DFlashDrafter


def load_drafter(
    directory: str | Path, *, device: torch.device, dtype: torch.dtype
) -> tuple[DFlashDrafter, DFlashSpec]:
    """Build the drafter from `directory` and load its weights (every parameter must be present)."""
    path = Path(directory)
    raw, spec = read_config(path)
    config = Qwen3Config.from_dict(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} holds no weights (*.safetensors)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    drafter = DFlashDrafter(config, len(spec.target_layer_ids), layer_windows(raw))
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
