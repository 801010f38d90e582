"""Verifier backends. Each backend is imported only when selected, so neither requires the other's framework."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kv_cache_proposer.backends.choices import BACKENDS, COMPILE_MODES, KV_DTYPES, TORCH_FORWARDS, WEIGHTS
from kv_cache_proposer.verifier import Verifier

__all__ = ["BACKENDS", "COMPILE_MODES", "KV_DTYPES", "TORCH_FORWARDS", "WEIGHTS", "load_verifier", "runs_on_cpu"]


def load_verifier(
    backend: str,
    model_dir: str | Path,
    *,
    device: str = "auto",
    dtype: str = "auto",
    torch_forward: str = "auto",
    compile: str = "auto",
    weights: str = "float32",
    kv_dtype: str = "auto",
) -> Verifier[Any]:
    """Load a verifier from a local model directory with the named backend.

    `torch` serves Hugging Face checkpoints (devices auto, cpu, cuda, cuda:N, mps); `mlx` serves mlx-lm model
    directories (devices auto, cpu, gpu). `dtype` auto is float32 on a CPU for both. `torch_forward` (one of
    `TORCH_FORWARDS`) chooses how the torch backend runs a forward and `compile` (one of `COMPILE_MODES`) whether
    it compiles its decode steps (`TorchVerifier`). `weights` (one of `WEIGHTS`) is how the linear layers are held:
    float32 keeps the dtype's, the others quantize at load. `kv_dtype` (one of `KV_DTYPES`) is how a session's
    dense K/V are held: in the model's dtype, or (torch's direct forward only) rounded to bfloat16; auto as
    `TorchVerifier` resolves it, and the model's dtype on mlx.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; expected one of {', '.join(WEIGHTS)}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}; expected one of {', '.join(KV_DTYPES)}")
    if backend == "torch":
        from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier

        return TorchVerifier.load(
            model_dir,
            device=device,
            dtype=dtype,
            forward=torch_forward,
            compile=compile,
            weights=weights,
            kv_dtype=kv_dtype,
        )
    if backend == "mlx":
        if kv_dtype == "bfloat16":
            raise ValueError("the mlx backend holds K/V in the model's dtype; kv_dtype bfloat16 is torch's")
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
