"""The MLX backend on a Linux CPU with the wheel's own BLAS (what this test process runs: it never chooses another,
see `backends/mlx_blas.py`): a token's values bit for bit whatever the shape of the blocks that delivered its history
and whatever rows share its forward, for unbounded and bounded caches alike (a bounded cache hands attention its
keys at places set by their positions, `key_block`). With the system OpenBLAS they agree within float32 rounding
(`tests/integration/test_mlx_blas.py`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kv_cache_proposer.backends.mlx_backend.verifier import _CPU_KEY_BLOCK, MlxVerifier
from kv_cache_proposer.backends.mlx_blas import active_mlx_blas
from kv_cache_proposer.strategies import FullStrategy, KVStrategy
from kv_cache_proposer.verifier import BatchBlock
from tests.support.backends import to_numpy
from tests.support.decoding import BOUNDED, DELIVERIES, delivered_values, random_tokens

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

STRATEGIES: dict[str, KVStrategy] = {"full": FullStrategy(), **BOUNDED}


@pytest.mark.parametrize("weights", ["float32", "int4"])
@pytest.mark.parametrize("strategy", list(STRATEGIES.values()), ids=list(STRATEGIES))
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_a_history_gives_the_same_values_however_it_was_delivered(verifier_pool, arch, strategy, weights):
    verifier = MlxVerifier.load(verifier_pool.model_dir("mlx", arch), device="cpu", weights=weights)
    results = {name: delivered_values(verifier, strategy, sizes) for name, sizes in DELIVERIES.items()}
    expected = results["one block"]
    for name, got in results.items():
        assert all(np.array_equal(to_numpy(a), to_numpy(b)) for a, b in zip(got, expected, strict=True)), name


@pytest.mark.parametrize("routed", [True, False], ids=["row by row", "padded"])
@pytest.mark.parametrize("strategy", list(STRATEGIES.values()), ids=list(STRATEGIES))
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_a_block_gives_the_same_values_alone_and_among_other_sessions(verifier_pool, arch, strategy, routed):
    """Each row over its own keys (the model's attention routed: `attention.route_rows`), and every row's keys
    padded to the longest under one mask (a model whose attention is not)."""
    verifier = MlxVerifier.load(verifier_pool.model_dir("mlx", arch), device="cpu")
    assert verifier.rows_routed
    verifier.rows_routed = routed

    def prefilled(seed: int, length: int):
        cache = verifier.new_cache(strategy)
        verifier.verify(cache, random_tokens(seed, length), 1)
        verifier.commit(cache, length)
        return cache

    for block in (random_tokens(2, 1), random_tokens(2, 5)):
        alone = np.array(verifier.verify(prefilled(1, 1100), block, len(block)).logits)
        for others in ([37], [37, 700, 1500]):
            rows = [BatchBlock(prefilled(10 + length, length), block, len(block)) for length in others]
            rows.insert(len(rows) // 2, BatchBlock(prefilled(1, 1100), block, len(block)))
            outputs = verifier.verify_batch(rows)
            assert np.array_equal(np.array(outputs[len(others) // 2].logits), alone), (len(block), others)


@pytest.mark.parametrize("dim", [16, 64])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (4, 2), (9, 3)])
def test_attention_on_a_cpu_reads_whole_masked_key_blocks_as_nothing(dim, heads, kv_heads):
    """What `key_block` stands on: MLX's attention gives a query the same values when whole blocks of masked keys
    lie before, between or after the keys it reads."""
    size, count, cut = _CPU_KEY_BLOCK, 1536, 512  # blocks go in at a block boundary
    with mx.stream(mx.cpu):
        mx.random.seed(dim + heads)
        keys, values = (mx.random.normal((1, kv_heads, count, dim)) for _ in range(2))
        queries = mx.random.normal((1, heads, 8, dim))
        visible = np.zeros((8, count), dtype=bool)
        visible[:, :4] = True  # a sink
        visible[:, 700:1300] = np.tril(np.ones((8, 600), dtype=bool), k=592)  # a window, causal at its end

        def attend(inserted: int, appended: int) -> np.ndarray:
            def laid(x: mx.array) -> mx.array:
                gap = mx.zeros((1, x.shape[1], inserted * size, x.shape[3]))
                tail = mx.zeros((1, x.shape[1], appended * size, x.shape[3]))
                return mx.concatenate([x[:, :, :cut], gap, x[:, :, cut:], tail], axis=2)

            hidden = (np.zeros((8, inserted * size), bool), np.zeros((8, appended * size), bool))
            mask = np.concatenate([visible[:, :cut], hidden[0], visible[:, cut:], hidden[1]], axis=1)
            out = mx.fast.scaled_dot_product_attention(
                queries, laid(keys), laid(values), scale=dim**-0.5, mask=mx.array(mask)
            )
            return np.array(out)

        expected = attend(0, 0)
        for inserted, appended in ((1, 0), (0, 1), (3, 2), (6, 0), (17, 5)):
            assert np.array_equal(attend(inserted, appended), expected), (inserted, appended)


def test_a_cpu_verifier_lays_a_bounded_cache_s_keys_out_in_blocks(verifier_pool):
    assert active_mlx_blas().bundled
    verifier = MlxVerifier.load(verifier_pool.model_dir("mlx", "qwen3"), device="cpu")
    assert verifier.key_block == _CPU_KEY_BLOCK == 64
