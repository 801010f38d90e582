"""Every verifier backend against references computed with plain transformers forwards of the same weights."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kv_cache_proposer.backends import load_verifier
from kv_cache_proposer.errors import InvariantViolation, ModelLoadError
from kv_cache_proposer.strategies import FullStrategy, KVStrategy, SinkWindowStrategy
from tests.support.backends import BACKENDS, to_numpy
from tests.support.checkpoints import VOCAB_SIZE

ARCHS = ["qwen3", "llama", "gemma3"]
# Both backends compute in float32; a forward through a cache differs from one uncached forward of another
# framework only by summation order (measured max |diff| ~1e-5 on these models).
ATOL = RTOL = 1e-4

pytestmark = pytest.mark.parametrize("backend", BACKENDS)


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def _logits_through_cache(verifier, strategy: KVStrategy, tokens: list[int], chunks: list[int]):
    """Feed `tokens` in chunks of the given sizes, committing each; return logits of every position [T, V]."""
    cache = verifier.new_cache(strategy)
    rows, start = [], 0
    for size in chunks:
        block = tokens[start : start + size]
        rows.append(to_numpy(verifier.verify(cache, block, len(block)).logits))
        verifier.commit(cache, len(block))
        start += size
    assert start == len(tokens)
    return np.concatenate(rows), cache


def _masked_reference(model, strategy: KVStrategy, tokens: list[int]) -> np.ndarray:
    """One transformers forward over the whole sequence with the strategy's visibility as an explicit mask."""
    positions = torch.arange(len(tokens))
    q, k = positions[:, None], positions[None, :]
    allowed = (k <= q) & strategy.visible(q, k)
    config = model.config
    mask: torch.Tensor | dict[str, torch.Tensor] = allowed[None, None]
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        mask = {
            "full_attention": allowed[None, None],
            "sliding_attention": (allowed & (q - k < config.sliding_window))[None, None],
        }
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), attention_mask=mask, position_ids=positions[None])
    return to_numpy(out.logits[0])


@pytest.mark.parametrize("arch", ARCHS)
def test_full_strategy_logits_match_an_uncached_forward(verifiers, reference_models, arch):
    tokens = _tokens(1, 40)
    logits, _ = _logits_through_cache(verifiers[arch], FullStrategy(), tokens, [13, 1, 1, 7, 18])
    with torch.no_grad():
        reference = to_numpy(reference_models[arch](input_ids=torch.tensor([tokens])).logits[0])
    np.testing.assert_allclose(logits, reference, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunks", [[60], [1] * 60, [9, 17, 1, 1, 32]])
def test_sink_window_logits_match_masked_full_attention(verifiers, reference_models, arch, chunks):
    verifier = verifiers[arch]
    strategy = SinkWindowStrategy(sink=3, window=10)
    tokens = _tokens(2, 60)
    logits, cache = _logits_through_cache(verifier, strategy, tokens, chunks)
    reference = _masked_reference(reference_models[arch], strategy, tokens)
    np.testing.assert_allclose(logits, reference, atol=ATOL, rtol=RTOL)
    assert cache.resident_count == 13 and cache.evicted_count == 47
    for layer in range(verifier.num_layers):
        _, _, positions = cache.resident_kv(layer)
        assert positions.tolist() == [0, 1, 2, *range(50, 60)]


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
@pytest.mark.parametrize("strategy", [FullStrategy(), SinkWindowStrategy(sink=3, window=10)], ids=["full", "sink"])
def test_a_long_block_asked_for_its_last_rows_stages_every_position(verifiers, reference_models, arch, strategy):
    """Only the last rows' logits are returned, but every position's K/V is staged and later queries see it."""
    verifier = verifiers[arch]
    tokens = _tokens(5, 120)
    cache = verifier.new_cache(strategy)
    last_rows = to_numpy(verifier.verify(cache, tokens[:110], 2).logits)
    verifier.commit(cache, 110)
    rest = to_numpy(verifier.verify(cache, tokens[110:], 10).logits)
    verifier.commit(cache, 10)
    reference = _masked_reference(reference_models[arch], strategy, tokens)
    np.testing.assert_allclose(last_rows, reference[108:110], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(rest, reference[110:], atol=ATOL, rtol=RTOL)
    assert cache.resident_count == strategy.resident_count(120)


def test_sink_window_memory_is_flat_once_the_window_is_full(verifiers):
    verifier = verifiers["qwen3"]
    cache = verifier.new_cache(SinkWindowStrategy(sink=2, window=8))
    sizes = []
    for token in _tokens(3, 40):
        verifier.verify(cache, [token], 1)
        verifier.commit(cache, 1)
        sizes.append(cache.nbytes)
    assert len(set(sizes[10:])) == 1
    full = verifier.new_cache(FullStrategy())
    verifier.verify(full, _tokens(3, 400), 1)
    verifier.commit(full, 400)
    assert full.nbytes > sizes[-1] * 10


@pytest.mark.parametrize("strategy", [FullStrategy(), SinkWindowStrategy(sink=2, window=6)], ids=["full", "sink"])
def test_rejected_staged_kv_never_reach_the_resident_cache(verifiers, strategy):
    verifier = verifiers["llama"]
    tokens = _tokens(4, 30)
    accepted_then_rejected = verifier.new_cache(strategy)
    plain = verifier.new_cache(strategy)
    for cache in (accepted_then_rejected, plain):
        verifier.verify(cache, tokens[:20], 1)
        verifier.commit(cache, 20)
    # Stage 6 positions but commit only 2 of them; the others are garbage drafts.
    verifier.verify(accepted_then_rejected, [*tokens[20:22], 1, 2, 3, 4], 6)
    verifier.commit(accepted_then_rejected, 2)
    verifier.verify(plain, tokens[20:22], 2)
    verifier.commit(plain, 2)
    assert accepted_then_rejected.evicted_count == plain.evicted_count
    for layer in range(verifier.num_layers):
        k1, v1, p1 = accepted_then_rejected.resident_kv(layer)
        k2, v2, p2 = plain.resident_kv(layer)
        assert p1.tolist() == p2.tolist()
        np.testing.assert_allclose(to_numpy(k1), to_numpy(k2), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(to_numpy(v1), to_numpy(v2), atol=1e-5, rtol=1e-5)


def test_commit_checks_every_layer_against_the_bookkeeping(verifiers):
    verifier = verifiers["qwen3"]
    cache = verifier.new_cache(FullStrategy())
    verifier.verify(cache, [1, 2, 3], 1)
    verifier.commit(cache, 3)
    cache._layers[1].held += 1  # a layer claims a K/V entry the history does not have
    verifier.verify(cache, [4], 1)
    with pytest.raises(InvariantViolation) as info:
        verifier.commit(cache, 1)
    assert info.value.kind == "inv1"


def test_commit_rejects_more_positions_than_staged(verifiers):
    verifier = verifiers["qwen3"]
    cache = verifier.new_cache(FullStrategy())
    verifier.verify(cache, [1, 2], 1)
    with pytest.raises(ValueError):
        verifier.commit(cache, 3)


def test_loading_a_directory_without_a_model_fails_clearly(backend, tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json is missing"):
        load_verifier(backend, tmp_path, device="cpu")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no weights"):
        load_verifier(backend, tmp_path, device="cpu")
