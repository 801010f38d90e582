"""The MLX verifier's input-major weights (its CPU default) against mlx-lm's own layout: the same weights, the same
values to float32 rounding, and the same tokens through every strategy and proposer."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kv_cache_proposer.backends import load_verifier
from kv_cache_proposer.backends.mlx_backend.layout import InputMajorEmbedding, InputMajorLinear, input_major
from kv_cache_proposer.backends.mlx_backend.verifier import MlxVerifier
from kv_cache_proposer.strategies import FullStrategy, SinkWindowStrategy
from tests.support.checkpoints import ARCHITECTURES
from tests.support.decoding import DECODE_STRATEGIES, PROPOSERS, SAMPLINGS, decode, proposer_options, random_tokens


def _pair(model_dir: Path) -> tuple[MlxVerifier, MlxVerifier]:
    """mlx-lm's layout and the input-major one, of one converted checkpoint."""
    plain = MlxVerifier.load(model_dir, device="cpu", dtype="float32", input_major=False)
    major = MlxVerifier.load(model_dir, device="cpu", dtype="float32")
    assert major.input_major and not plain.input_major
    return plain, major


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_a_cpu_model_holds_every_weight_once_input_major(verifier_pool, arch):
    plain, major = _pair(verifier_pool.model_dir("mlx", arch))
    plain_modules = dict(plain.model.named_modules())
    replaced = 0
    for name, module in major.model.named_modules():
        if isinstance(module, InputMajorLinear | InputMajorEmbedding):
            original = plain_modules[name]
            assert type(original) is (nn.Linear if isinstance(module, InputMajorLinear) else nn.Embedding)
            assert module.weight_t.shape == original.weight.shape[::-1]
            assert mx.array_equal(module.weight, original.weight)
            replaced += 1
    assert replaced > 0 and not any(type(m) in (nn.Linear, nn.Embedding) for _, m in major.model.named_modules())
    weights = [tree_flatten(v.model.parameters()) for v in (plain, major)]
    assert sum(a.nbytes for _, a in weights[0]) == sum(a.nbytes for _, a in weights[1])
    assert f", weights: input-major ({replaced} modules)" in major.description
    assert "input-major" not in plain.description


def test_only_plain_linear_layers_and_embeddings_change():
    class Linear2(nn.Linear):
        pass

    model = nn.Module()
    model.plain = nn.Linear(32, 8, bias=True)
    model.subclass = Linear2(32, 8)
    model.quantized = nn.QuantizedLinear(64, 8, group_size=32, bits=4)
    model.blocks = [nn.Linear(8, 4), nn.RMSNorm(8)]
    x = mx.random.normal((2, 32), key=mx.random.key(0))
    expected = model.plain(x)
    assert input_major(model) == 2
    assert isinstance(model.plain, InputMajorLinear) and isinstance(model.blocks[0], InputMajorLinear)
    assert type(model.subclass) is Linear2 and type(model.quantized) is nn.QuantizedLinear
    assert isinstance(model.blocks[1], nn.RMSNorm)
    assert np.allclose(np.array(model.plain(x)), np.array(expected), atol=1e-6)


def test_the_layout_changes_one_module_at_a_time():
    model = nn.Module()
    model.blocks = [nn.Linear(1024, 1024, bias=False) for _ in range(8)]
    model.head = nn.Linear(1024, 1024)
    mx.eval(model.parameters())
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    assert input_major(model) == 9
    one = 1024 * 1024 * 4
    assert mx.get_peak_memory() <= held + 2 * one  # never all the weights twice
    assert mx.get_active_memory() <= held + one // 64


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("strategy", [FullStrategy(), SinkWindowStrategy(sink=2, window=8)], ids=["full", "sink"])
def test_every_forward_of_a_session_gives_the_values_of_mlx_lms_layout(verifier_pool, arch, strategy):
    pair = _pair(verifier_pool.model_dir("mlx", arch))
    layers = (0, pair[0].num_layers - 1)
    caches = [v.new_cache(strategy) for v in pair]
    tokens = random_tokens(1, 40)
    # a first chunk, a chunk over history with a rejected tail, then single-token steps past the window
    blocks = [(tokens[:10], 10, 10), (tokens[10:17], 7, 5), *[([t], 1, 1) for t in tokens[17:32]]]
    for block, rows, keep in blocks:
        outs = [v.verify(c, block, rows, feature_layers=layers) for v, c in zip(pair, caches, strict=True)]
        assert np.allclose(np.array(outs[1].logits), np.array(outs[0].logits), rtol=1e-5, atol=1e-5)
        assert outs[0].features is not None and outs[1].features is not None
        assert np.allclose(np.array(outs[1].features), np.array(outs[0].features), rtol=1e-5, atol=1e-5)
        for verifier, cache in zip(pair, caches, strict=True):
            verifier.commit(cache, keep)


@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("strategy", list(DECODE_STRATEGIES.values()), ids=list(DECODE_STRATEGIES))
def test_decoding_gives_the_same_tokens_with_either_layout(verifier_pool, tmp_path, proposer, strategy):
    options = proposer_options(proposer, tmp_path)
    plain, major = _pair(verifier_pool.model_dir("mlx", "qwen3"))
    for params in SAMPLINGS:
        tokens = decode(plain, "mlx", strategy, options, params)
        assert decode(major, "mlx", strategy, options, params) == tokens
        assert len(set(tokens)) > 3


def test_the_default_cpu_load_is_input_major(verifier_pool):
    verifier = load_verifier("mlx", verifier_pool.model_dir("mlx", "qwen3"), device="cpu", dtype="float32")
    assert isinstance(verifier, MlxVerifier) and verifier.input_major
