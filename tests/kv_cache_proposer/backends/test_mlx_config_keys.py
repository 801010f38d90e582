"""A Hugging Face directory saved by transformers 5 loads on the MLX backend with the RoPE settings it names."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kv_cache_proposer.backends.mlx_backend.config_keys import ConfigKeysError, mlx_config_keys, sliding_window_pattern
from kv_cache_proposer.backends.mlx_backend.loader import load_mlx_model
from tests.support.checkpoints import COMMON_SHAPE


def _llama(directory: Path, rope_theta: float) -> Path:
    config = LlamaConfig(
        initializer_range=0.02, rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, **COMMON_SHAPE
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def test_a_non_default_rope_theta_saved_as_rope_parameters_reaches_mlx_lm(tmp_path):
    directory = _llama(tmp_path / "llama", rope_theta=500000.0)
    assert '"rope_theta"' in (directory / "config.json").read_text()
    ids = list(range(3, 40))
    reference = AutoModelForCausalLM.from_pretrained(directory)(torch.tensor([ids])).logits[0].detach().numpy()
    loaded = load_mlx_model(directory, mx.float32)
    logits = np.array(loaded.model(mx.array([ids])))[0]
    np.testing.assert_allclose(logits, reference, atol=1e-4)


def test_config_keys_add_only_what_the_config_lacks():
    assert mlx_config_keys({"rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}) == {"rope_theta": 1e5}
    assert mlx_config_keys({"rope_theta": 7.0, "rope_parameters": {"rope_theta": 1e5}}) == {}
    scaled = {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}
    assert mlx_config_keys({"rope_parameters": scaled}) == {"rope_theta": 1e4, "rope_scaling": scaled}
    gemma = {
        "model_type": "gemma3_text",
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
        "rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}},
    }
    assert mlx_config_keys(gemma) == {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 3}


def test_layer_types_without_a_period_are_refused():
    with pytest.raises(ConfigKeysError, match="no period"):
        sliding_window_pattern(["full_attention", "sliding_attention", "sliding_attention"])
