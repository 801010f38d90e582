"""Loading local Hugging Face checkpoints (never from a hub)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kv_cache_proposer.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    """`auto` picks cuda, then mps, then cpu; an explicit device must be available."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but CUDA is not available")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError("device 'mps' requested but MPS is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on cpu, bfloat16 on cuda and float16 on mps."""
    if name == "auto":
        return {"cuda": torch.bfloat16, "mps": torch.float16}.get(device.type, torch.float32)
    try:
        return _DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {name!r}; expected one of {', '.join(sorted(_DTYPES))}") from None


def load_causal_lm(model_dir: str | Path, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """Load a causal LM from a local checkpoint directory (config.json + safetensors) in eval mode."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a model directory: config.json is missing")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ModelLoadError(f"{path} holds no weights (*.safetensors)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, attn_implementation="sdpa"
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load {path} as a causal LM: {exc}") from exc
    model.to(device)  # type: ignore[arg-type]  # transformers types its .to() wrapper too narrowly
    model.eval()
    return model
