"""Verifier backends. Each backend is imported only when selected, so neither requires the other's framework."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kv_cache_proposer.backends.choices import BACKENDS, COMPILE_MODES, TORCH_FORWARDS, WEIGHTS
from kv_cache_proposer.verifier import Verifier

__all__ = ["BACKENDS", "COMPILE_MODES", "TORCH_FORWARDS", "WEIGHTS", "load_verifier", "runs_on_cpu"]


def load_verifier(
    backend: str,
    model_dir: str | Path,
    *,
    device: str = "auto",
    dtype: str = "auto",
    torch_forward: str = "auto",
    compile: str = "auto",
    weights: str = "float32",
) -> Verifier[Any]:
    """Load a verifier from a local model directory with the named backend.

    `torch` serves Hugging Face checkpoints (devices auto, cpu, cuda, cuda:N, mps); `mlx` serves mlx-lm model
    directories (devices auto, cpu, gpu). `dtype` auto is float32 on a CPU for both. `torch_forward` (one of
    `TORCH_FORWARDS`) chooses how the torch backend runs a forward and `compile` (one of `COMPILE_MODES`) whether
    it compiles its decode steps (`TorchVerifier`). `weights` (one of `WEIGHTS`) is how the linear layers are held:
    float32 keeps the dtype's, the others quantize at load.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; expected one of {', '.join(WEIGHTS)}")
    if backend == "torch":
        from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier

        return TorchVerifier.load(
            model_dir, device=device, dtype=dtype, forward=torch_forward, compile=compile, weights=weights
        )
    if backend == "mlx":
        from kv_cache_proposer.backends.mlx_backend.verifier import MlxVerifier

        return MlxVerifier.load(model_dir, device=device, dtype=dtype, weights=weights)
    raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")


def runs_on_cpu(backend: str, device: str) -> bool:
    """Whether a verifier of `backend` loaded on `device` runs on a CPU, `auto` resolved as that backend resolves
    it."""
    if backend == "torch":
        from kv_cache_proposer.backends.torch_backend.loader import resolve_device as torch_device

        return torch_device(device).type == "cpu"
    if backend == "mlx":
        import mlx.core as mx

        from kv_cache_proposer.backends.mlx_backend.loader import resolve_device as mlx_device

        return mlx_device(device).type == mx.cpu
    raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
