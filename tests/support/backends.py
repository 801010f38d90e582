"""The tiny checkpoints served by every verifier backend: converted and loaded on first use, kept for the session."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from kv_cache_proposer.backends import BACKENDS, load_verifier
from kv_cache_proposer.verifier import Verifier

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["BACKENDS", "VerifierPool", "assert_steps_meet_the_block", "convert_script", "to_numpy"]


@cache
def convert_script() -> ModuleType:
    """`scripts/convert_hf_to_mlx.py` imported as a module."""
    spec = importlib.util.spec_from_file_location("convert_hf_to_mlx", ROOT / "scripts" / "convert_hf_to_mlx.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class VerifierPool:
    """fp32 CPU verifiers of the tiny Hugging Face checkpoints, per backend; MLX serves converted copies."""

    def __init__(self, checkpoints: Mapping[str, Path], root: Path) -> None:
        self._checkpoints = checkpoints
        self._root = root
        self._loaded: dict[tuple[str, str], Verifier] = {}

    def model_dir(self, backend: str, arch: str) -> Path:
        source = self._checkpoints[arch]
        if backend == "torch":
            return source
        target = self._root / backend / arch
        if not target.exists():
            convert_script().convert(source, target, dtype="float32")
        return target

    def get(self, backend: str, arch: str) -> Verifier:
        key = (backend, arch)
        if key not in self._loaded:
            self._loaded[key] = load_verifier(backend, self.model_dir(backend, arch), device="cpu", dtype="float32")
        return self._loaded[key]

    def for_backend(self, backend: str) -> Mapping[str, Any]:
        return _BackendView(self, backend)


class _BackendView(Mapping[str, Any]):
    """arch -> verifier of one backend, loading each on first access."""

    def __init__(self, pool: VerifierPool, backend: str) -> None:
        self._pool = pool
        self._backend = backend

    def __getitem__(self, arch: str) -> Any:
        return self._pool.get(self._backend, arch)

    def __iter__(self) -> Iterator[str]:
        return iter(self._pool._checkpoints)

    def __len__(self) -> int:
        return len(self._pool._checkpoints)


def to_numpy(array: Any) -> np.ndarray:
    """A host float64 copy of a torch tensor or an MLX array."""
    if hasattr(array, "detach"):
        array = array.detach().cpu().double().numpy()
    return np.asarray(array, dtype=np.float64)


def assert_steps_meet_the_block(verifier: Any, tokens: list[int], prefill: int) -> None:
    """A torch verifier gives each token after a `prefill`-token prefill the same logits, bit for bit, in decode
    steps as in one block of all `tokens`."""
    import torch

    from kv_cache_proposer.strategies import FullStrategy

    block = verifier.verify(verifier.new_cache(FullStrategy()), tokens, len(tokens)).logits.clone()
    stepwise = verifier.new_cache(FullStrategy())
    verifier.verify(stepwise, tokens[:prefill], prefill)
    verifier.commit(stepwise, prefill)
    for i, token in enumerate(tokens[prefill:], start=prefill):
        assert torch.equal(verifier.verify(stepwise, [token], 1).logits[-1], block[i]), i
        verifier.commit(stepwise, 1)
