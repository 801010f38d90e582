"""The MLX backend quantizes a model at load with `--weights int8|int4` (mlx's affine groups of 32, the embedding
and LM head at 8 bits), and refuses a choice it does not hold."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kv_cache_proposer.backends.mlx_backend.verifier import MlxVerifier
from kv_cache_proposer.errors import ModelLoadError

PROMPT = list(range(3, 40))
# Largest logit error against float32 relative to the largest logit, on the tiny random test model (see the torch
# backend's weights tests for why int4 moves a random model's logits this much).
TOLERANCES = {"int8": 0.08, "int4": 0.6}


def _logits(verifier: MlxVerifier) -> np.ndarray:
    return np.array(verifier.model(mx.array([PROMPT])))[0]  # [T, V]


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_int8_and_int4_quantize_the_layers_and_stay_near_float32(verifier_pool, weights):
    directory = verifier_pool.model_dir("mlx", "llama")
    reference = _logits(MlxVerifier.load(directory, device="cpu"))
    verifier = MlxVerifier.load(directory, device="cpu", weights=weights)
    assert verifier.weights == weights and f"weights: {weights}" in verifier.description
    layers = verifier.model.model.layers[0]
    bits = {"int8": 8, "int4": 4}[weights]
    assert isinstance(layers.mlp.down_proj, nn.QuantizedLinear) and layers.mlp.down_proj.bits == bits
    assert verifier.model.model.embed_tokens.bits == 8, "the embedding (and a tied head) stays at 8 bits"
    logits = _logits(verifier)
    assert float(np.abs(logits - reference).max() / np.abs(reference).max()) < TOLERANCES[weights]


def test_bfloat16_weights_are_refused_with_the_flag_that_does_it(verifier_pool):
    with pytest.raises(ModelLoadError, match="--dtype bfloat16"):
        MlxVerifier.load(verifier_pool.model_dir("mlx", "llama"), device="cpu", weights="bfloat16")
