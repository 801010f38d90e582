"""The default prefill chunk: short on a CPU, as long as the activation bound allows on a GPU."""

from __future__ import annotations

import pytest

from kv_cache_proposer.backends.base import LoadedModelSpec
from kv_cache_proposer.decoding import Decoder


def spec(device: str, hidden_size: int, dtype: str) -> LoadedModelSpec:
    return LoadedModelSpec("torch", "qwen3", 1000, 4, hidden_size, device, dtype)


@pytest.mark.parametrize(
    ("device", "hidden_size", "dtype", "chunk"),
    [
        ("cpu", 896, "float32", 512),
        ("cpu", 64, "float32", 512),
        ("cuda:0", 896, "bfloat16", 8192),  # a 0.5B model: 256 MiB / (16 * 896 * 2 B) = 9,362 tokens, capped
        ("cuda:0", 4096, "bfloat16", 2048),  # 256 MiB / 128 KiB
        ("mps", 4096, "float32", 1024),
        ("gpu", 8192, "float16", 1024),
        ("cuda:1", 16384, "float32", 512),  # never below the CPU chunk
    ],
)
def test_the_default_prefill_chunk_follows_the_device_and_the_models_width(device, hidden_size, dtype, chunk):
    assert spec(device, hidden_size, dtype).prefill_chunk_tokens == chunk


def test_a_decoder_takes_its_verifiers_default_unless_told(verifiers):
    verifier = verifiers["qwen3"]
    assert Decoder(verifier).prefill_chunk_tokens == verifier.model_spec.prefill_chunk_tokens == 512
    assert Decoder(verifier, prefill_chunk_tokens=24).prefill_chunk_tokens == 24
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        Decoder(verifier, prefill_chunk_tokens=0)
