"""Batched forwards on every backend: several sessions' blocks in one model call give each what it gets alone."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kv_cache_proposer.backends.torch_backend import direct, exact_attention
from kv_cache_proposer.strategies import FullStrategy, KVStrategy, SinkWindowStrategy
from kv_cache_proposer.verifier import BatchBlock
from tests.support.backends import BACKENDS, to_numpy
from tests.support.checkpoints import VOCAB_SIZE

ARCHS = ["qwen3", "llama", "gemma3"]
# One batched model call sums in another order than a call per row (shapes differ); float32 keeps that ~1e-6.
ATOL = RTOL = 1e-4

pytestmark = pytest.mark.parametrize("backend", BACKENDS)

# (strategy, history committed before the batched forward, block length, logits rows): a decode step, a
# speculative block, a prefill chunk, a block over an evicting window, and a first block on an empty cache.
ROWS: list[tuple[KVStrategy, int, int, int]] = [
    (FullStrategy(), 9, 1, 1),
    (FullStrategy(), 23, 6, 6),
    (FullStrategy(), 4, 40, 1),
    (SinkWindowStrategy(sink=2, window=8), 30, 3, 3),
    (SinkWindowStrategy(sink=1, window=16), 0, 12, 4),
]


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def _prefilled(verifier, strategy: KVStrategy, history: list[int]):
    cache = verifier.new_cache(strategy)
    if history:
        verifier.verify(cache, history, 1)
        verifier.commit(cache, len(history))
    return cache


def _resident(verifier, cache) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    out = []
    for layer in range(verifier.num_layers):
        keys, values, positions = cache.resident_kv(layer)
        out.append((to_numpy(keys), to_numpy(values), positions))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_a_batched_forward_gives_every_row_what_it_gets_alone(verifiers, arch):
    verifier = verifiers[arch]
    layers = [0, verifier.num_layers - 1]
    alone, batched, blocks, commits = [], [], [], []
    for seed, (strategy, history_len, block_len, rows) in enumerate(ROWS):
        history, block = _tokens(seed, history_len), _tokens(100 + seed, block_len)
        cache = _prefilled(verifier, strategy, history)
        out = verifier.verify(cache, block, rows, feature_layers=layers)
        commit = block_len - (seed % 2)  # some rows drop the end of their stage, as a rejected draft does
        verifier.commit(cache, commit)
        alone.append((to_numpy(out.logits), to_numpy(out.features), _resident(verifier, cache)))
        twin = _prefilled(verifier, strategy, history)
        blocks.append(BatchBlock(twin, block, rows))
        batched.append(twin)
        commits.append(commit)

    outs = verifier.verify_batch(blocks, feature_layers=layers)

    assert len(outs) == len(ROWS)
    for (logits, features, resident), out, cache, commit in zip(alone, outs, batched, commits, strict=True):
        np.testing.assert_allclose(to_numpy(out.logits), logits, atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(to_numpy(out.features), features, atol=ATOL, rtol=RTOL)
        verifier.commit(cache, commit)
        for (keys, values, positions), (b_keys, b_values, b_positions) in zip(
            resident, _resident(verifier, cache), strict=True
        ):
            np.testing.assert_array_equal(b_positions, positions)
            np.testing.assert_allclose(b_keys, keys, atol=ATOL, rtol=RTOL)
            np.testing.assert_allclose(b_values, values, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_direct_forward_s_rows_get_the_bits_they_get_alone(verifiers, backend, arch, attention_path, monkeypatch):
    """The direct forward's rows of different history lengths (within one segment of the attention kernel's keys
    and across several), decode steps beside a speculative block: each row's logits and staged K/V are those of
    its block alone, bit for bit, on either attention path (the compiled kernel attends the rows in one call)."""
    if backend != "torch":
        pytest.skip("the direct forward and its attention paths are the torch backend's (MLX: test_mlx_exact.py)")
    verifier = verifiers[arch]
    together = []
    attend_rows = exact_attention.attend_exact_rows

    def counted(*args, **kwargs):
        outputs = attend_rows(*args, **kwargs)
        together.append(outputs is not None)
        return outputs

    monkeypatch.setattr(direct, "attend_exact_rows", counted)
    shapes = [(9, 1), (600, 1), (1100, 4), (300, 1)]
    alone, blocks, twins = [], [], []
    for seed, (history_len, block_len) in enumerate(shapes):
        history, block = _tokens(seed, history_len), _tokens(200 + seed, block_len)
        cache = _prefilled(verifier, FullStrategy(), history)
        out = verifier.verify(cache, block, block_len)
        verifier.commit(cache, block_len)
        alone.append((to_numpy(out.logits), _resident(verifier, cache)))
        twin = _prefilled(verifier, FullStrategy(), history)
        blocks.append(BatchBlock(twin, block, block_len))
        twins.append((twin, block_len))

    outs = verifier.verify_batch(blocks)

    assert together and all(together) == (attention_path == "compiled")
    for (logits, resident), out, (twin, block_len) in zip(alone, outs, twins, strict=True):
        np.testing.assert_array_equal(to_numpy(out.logits), logits)
        verifier.commit(twin, block_len)
        for (keys, values, _), (b_keys, b_values, _) in zip(resident, _resident(verifier, twin), strict=True):
            np.testing.assert_array_equal(b_keys, keys)
            np.testing.assert_array_equal(b_values, values)


def test_a_batch_takes_one_block_per_cache(verifiers):
    verifier = verifiers["qwen3"]
    cache = verifier.new_cache(FullStrategy())
    with pytest.raises(ValueError, match="one block per session cache"):
        verifier.verify_batch([BatchBlock(cache, [1, 2], 1), BatchBlock(cache, [3], 1)])
