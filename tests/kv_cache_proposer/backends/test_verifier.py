"""The torch verifier against references computed with plain transformers forwards."""

from __future__ import annotations

import random

import pytest
import torch

from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.errors import InvariantViolation, ModelLoadError
from kv_cache_proposer.strategies import FullStrategy, KVStrategy, SinkWindowStrategy
from tests.support.checkpoints import VOCAB_SIZE

ARCHS = ["qwen3", "llama", "gemma3"]


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def _logits_through_cache(verifier: TorchVerifier, strategy: KVStrategy, tokens: list[int], chunks: list[int]):
    """Feed `tokens` in chunks of the given sizes, committing each; return logits of every position [T, V]."""
    cache = verifier.new_cache(strategy)
    rows, start = [], 0
    for size in chunks:
        block = tokens[start : start + size]
        rows.append(verifier.verify(cache, block, len(block)))
        verifier.commit(cache, len(block))
        start += size
    assert start == len(tokens)
    return torch.cat(rows), cache


def _masked_reference(verifier: TorchVerifier, strategy: KVStrategy, tokens: list[int]) -> torch.Tensor:
    """One full forward over the whole sequence with the strategy's visibility as an explicit mask."""
    positions = torch.arange(len(tokens))
    q, k = positions[:, None], positions[None, :]
    allowed = (k <= q) & strategy.visible(q, k)
    config = verifier.model.config
    mask: torch.Tensor | dict[str, torch.Tensor] = allowed[None, None]
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        mask = {
            "full_attention": allowed[None, None],
            "sliding_attention": (allowed & (q - k < config.sliding_window))[None, None],
        }
    with torch.no_grad():
        out = verifier.model(input_ids=torch.tensor([tokens]), attention_mask=mask, position_ids=positions[None])
    return out.logits[0].float()


@pytest.mark.parametrize("arch", ARCHS)
def test_full_strategy_logits_match_an_uncached_forward(verifiers, arch):
    verifier = verifiers[arch]
    tokens = _tokens(1, 40)
    logits, _ = _logits_through_cache(verifier, FullStrategy(), tokens, [13, 1, 1, 7, 18])
    with torch.no_grad():
        reference = verifier.model(input_ids=torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunks", [[60], [1] * 60, [9, 17, 1, 1, 32]])
def test_sink_window_logits_match_masked_full_attention(verifiers, arch, chunks):
    verifier = verifiers[arch]
    strategy = SinkWindowStrategy(sink=3, window=10)
    tokens = _tokens(2, 60)
    logits, cache = _logits_through_cache(verifier, strategy, tokens, chunks)
    torch.testing.assert_close(logits, _masked_reference(verifier, strategy, tokens), atol=1e-4, rtol=1e-4)
    assert cache.resident_count == 13 and cache.evicted_count == 47
    for layer in range(verifier.num_layers):
        _, _, positions = cache.resident_kv(layer)
        assert positions.tolist() == [0, 1, 2, *range(50, 60)]


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
        torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)


def test_commit_checks_every_layer_against_the_bookkeeping(verifiers):
    verifier = verifiers["qwen3"]
    cache = verifier.new_cache(FullStrategy())
    verifier.verify(cache, [1, 2, 3], 1)
    verifier.commit(cache, 3)
    cache._held[1] += 1  # a layer claims a K/V entry the history does not have
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


def test_loading_a_directory_without_a_model_fails_clearly(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json is missing"):
        TorchVerifier.load(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no weights"):
        TorchVerifier.load(tmp_path)
