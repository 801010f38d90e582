"""The default batch size: batched forwards on torch, one forward per step on MLX (whose batches pad)."""

from __future__ import annotations

import pytest

from kv_cache_proposer.backends.base import LoadedModelSpec
from tests.support.backends import BACKENDS


@pytest.mark.parametrize(
    ("backend", "device", "size"), [("torch", "cpu", 8), ("torch", "cuda:0", 8), ("mlx", "cpu", 1)]
)
def test_the_default_batch_size_follows_the_backend(backend, device, size):
    assert LoadedModelSpec(backend, "qwen3", 1000, 4, 64, device, "float32").batch_size == size


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_verifier_reports_its_backends_batch_size(verifiers, backend):
    assert verifiers["qwen3"].batch_size == (1 if backend == "mlx" else 8)
