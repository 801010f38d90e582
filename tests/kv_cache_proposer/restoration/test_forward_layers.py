"""The verifier's `forward_layers`, what a restoration rebuilds through: layers 0..last_layer stage their K/V, no
later layer runs, and those K/V are the ones a whole forward computes; on both backends and both torch forwards."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.cache import KVSessionCache
from kv_cache_proposer.restoration.rebuild import forward_kv
from kv_cache_proposer.strategies import FullStrategy
from tests.support.backends import BACKENDS, to_numpy
from tests.support.checkpoints import VOCAB_SIZE

TOKENS = [(7 * i + 3) % VOCAB_SIZE for i in range(19)]


class _Staged(KVSessionCache[Any]):
    """A full-attention cache that records which layers staged K/V."""

    def __init__(self, verifier: Any) -> None:
        super().__init__(FullStrategy(), num_layers=verifier.num_layers, ops=verifier.array_ops)
        self.layers: list[int] = []

    def stage_layer_parts(self, layer_idx: int, keys: Any, values: Any) -> tuple[Any, ...]:
        self.layers.append(layer_idx)
        return super().stage_layer_parts(layer_idx, keys, values)


def _whole_forward_kv(verifier: Any, layers: int) -> list[tuple[np.ndarray, np.ndarray]]:
    cache = verifier.new_cache(FullStrategy())
    verifier.verify(cache, TOKENS, 1)
    verifier.commit(cache, len(TOKENS))
    return [tuple(to_numpy(part) for part in cache.resident_kv(layer)[:2]) for layer in range(layers)]


def _check(verifier: Any, last_layer: int) -> None:
    staged = _Staged(verifier)
    verifier.forward_layers(staged, TOKENS, last_layer)
    assert staged.layers == list(range(last_layer + 1)), "layers after last_layer never run"
    captured = forward_kv(
        verifier.forward_layers, verifier.array_ops, verifier.num_layers, TOKENS, start=0, last_layer=last_layer
    )
    assert sorted(captured) == list(range(last_layer + 1))
    for layer, (keys, values) in enumerate(_whole_forward_kv(verifier, last_layer + 1)):
        np.testing.assert_allclose(to_numpy(captured[layer][0]), keys, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(to_numpy(captured[layer][1]), values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_first_layers_stage_what_a_whole_forward_computes_and_no_later_layer_runs(verifiers, arch):
    verifier = verifiers[arch]
    _check(verifier, 1)
    _check(verifier, verifier.num_layers - 1)


def test_the_transformers_modules_run_their_first_layers_only_and_get_every_layer_back(verifier_pool):
    model_dir = verifier_pool.model_dir("torch", "qwen3")
    library = TorchVerifier.load(model_dir, device="cpu", dtype="float32", forward="library")
    assert library.forward_path.startswith("transformers modules")
    layers = len(library.model.get_decoder().layers)
    _check(library, 1)
    assert len(library.model.get_decoder().layers) == layers, "the decoder holds all its layers again"
    _check(library, layers - 1)


def test_a_last_layer_outside_the_model_is_refused(verifiers):
    verifier = verifiers["qwen3"]
    with pytest.raises(ValueError, match="outside the model"):
        verifier.forward_layers(_Staged(verifier), TOKENS, verifier.num_layers)
