"""Batched forwards on every backend: several sessions' blocks in one model call give each what it gets alone."""

from __future__ import annotations

import random

import numpy as np
import pytest

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


def test_a_batch_takes_one_block_per_cache(verifiers):
    verifier = verifiers["qwen3"]
    cache = verifier.new_cache(FullStrategy())
    with pytest.raises(ValueError, match="one block per session cache"):
        verifier.verify_batch([BatchBlock(cache, [1, 2], 1), BatchBlock(cache, [3], 1)])
