"""Attention over chunks of keys merged by log-sum-exp equals attention over the whole history, on both backends:
chunks of 1, 7 and more than the history, with and without a causal block, for every K/V head grouping."""

from __future__ import annotations

import numpy as np
import pytest

HISTORY, QUERIES, DIM, KV_HEADS = 37, 5, 16, 2


def _reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, allowed: np.ndarray, scale: float) -> np.ndarray:
    """Plain softmax attention in float64, K/V heads repeated for their query heads."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = np.repeat(keys, groups, axis=1), np.repeat(values, groups, axis=1)
    scores = np.einsum("bhnd,bhkd->bhnk", q.astype(np.float64), keys.astype(np.float64)) * scale
    scores = np.where(allowed, scores, -np.inf)
    with np.errstate(invalid="ignore"):  # a query that reads no key: NaN here, zeros from the merge
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("bhnk,bhkd->bhnd", weights, values.astype(np.float64))


def _attend(backend: str, q: np.ndarray, chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]], scale: float):
    if backend == "torch":
        import torch

        from kv_cache_proposer.backends.torch_backend.chunked_attention import attend_chunks

        parts = [
            (torch.from_numpy(k), torch.from_numpy(v), None if a is None else torch.from_numpy(a)) for k, v, a in chunks
        ]
        return attend_chunks(torch.from_numpy(q), parts, scale=scale).numpy()
    import mlx.core as mx

    from kv_cache_proposer.backends.mlx_backend.chunked_attention import attend_chunks as mlx_attend_chunks

    mlx_parts = [(mx.array(k), mx.array(v), None if a is None else mx.array(a)) for k, v, a in chunks]
    return np.array(mlx_attend_chunks(mx.array(q), mlx_parts, scale=scale))


def _inputs(groups: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, KV_HEADS * groups, QUERIES, DIM)).astype(np.float32)
    keys = rng.standard_normal((1, KV_HEADS, HISTORY + QUERIES, DIM)).astype(np.float32)
    values = rng.standard_normal((1, KV_HEADS, HISTORY + QUERIES, DIM)).astype(np.float32)
    return q, keys, values


@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunks_merged_by_log_sum_exp_equal_attention_over_the_whole_history(backend, groups, causal, chunk):
    q, keys, values = _inputs(groups, seed=groups * 10 + chunk)
    total = HISTORY + QUERIES
    allowed = np.ones((QUERIES, total), dtype=bool)  # the history, then the block's own keys
    if causal:
        allowed[:, HISTORY:] = np.tril(np.ones((QUERIES, QUERIES), dtype=bool))
    scale = DIM**-0.5
    chunks = [
        (keys[:, :, start : start + chunk], values[:, :, start : start + chunk], allowed[:, start : start + chunk])
        for start in range(0, total, chunk)
    ]
    expected = _reference(q, keys, values, allowed, scale)
    np.testing.assert_allclose(_attend(backend, q, chunks, scale), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_a_chunk_without_a_mask_is_read_whole_and_a_query_that_reads_nothing_gets_zeros(backend):
    q, keys, values = _inputs(2, seed=3)
    scale = DIM**-0.5
    allowed = np.ones((QUERIES, HISTORY + QUERIES), dtype=bool)
    allowed[0] = False  # the first query may read no key at all
    chunks = [
        (keys[:, :, :HISTORY], values[:, :, :HISTORY], allowed[:, :HISTORY]),
        (keys[:, :, HISTORY:], values[:, :, HISTORY:], allowed[:, HISTORY:]),
    ]
    out = _attend(backend, q, chunks, scale)
    assert np.all(out[:, :, 0] == 0)
    np.testing.assert_allclose(out[:, :, 1:], _reference(q, keys, values, allowed, scale)[:, :, 1:], atol=2e-5)
    whole = _attend(backend, q, [(keys, values, None)], scale)
    np.testing.assert_allclose(whole, _reference(q, keys, values, np.ones_like(allowed), scale), atol=2e-5)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_no_chunk_is_an_error(backend):
    q, _, _ = _inputs(1, seed=0)
    with pytest.raises(ValueError, match="at least one chunk"):
        _attend(backend, q, [], DIM**-0.5)
