"""Verifier backends. Each backend is imported only when selected, so neither requires the other's framework."""

from __future__ import annotations

from pathlib import Path

from kv_cache_proposer.verifier import Verifier

BACKENDS = ("torch",)


def load_verifier(backend: str, model_dir: str | Path, *, device: str = "auto", dtype: str = "auto") -> Verifier:
    """Load a verifier from a local model directory with the named backend."""
    if backend == "torch":
        from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier

        return TorchVerifier.load(model_dir, device=device, dtype=dtype)
    raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
