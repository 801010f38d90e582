"""The default batch size: batched forwards on both backends; on MLX only where its rows are attended row by row."""

from __future__ import annotations

import pytest

from kv_cache_proposer.backends.base import LoadedModelSpec
from tests.support.backends import BACKENDS


@pytest.mark.parametrize(("backend", "device"), [("torch", "cpu"), ("torch", "cuda:0"), ("mlx", "cpu")])
def test_the_default_batch_size_is_sixteen(backend, device):
    assert LoadedModelSpec(backend, "qwen3", 1000, 4, 64, device, "float32").batch_size == 16


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_verifier_reports_its_backends_batch_size(verifiers, backend):
    verifier = verifiers["qwen3"]
    assert verifier.batch_size == 16
    if backend == "mlx":  # a model whose attention is not routed would batch padded, which does not pay
        assert verifier.rows_routed
        verifier.rows_routed = False
        try:
            assert verifier.batch_size == 1
        finally:
            verifier.rows_routed = True
