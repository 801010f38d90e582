"""Dense K/V held at bfloat16 (`kv_dtype`): what auto chooses, what a cache holds, and that a token's values still
do not depend on how its history was delivered or which sessions share its forward."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kv_cache_proposer.backends import load_verifier
from kv_cache_proposer.backends.torch_backend.arrays import TorchArrayOps
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.cache import DenseLayerStore
from kv_cache_proposer.compression import KVCompressor, compressor_layer_store
from kv_cache_proposer.errors import ModelLoadError
from kv_cache_proposer.strategies import DlmRestoreStrategy, FullStrategy, KVStrategy, SinkWindowStrategy
from kv_cache_proposer.verifier import BatchBlock
from tests.support.checkpoints import VOCAB_SIZE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STRATEGIES = {"full": FullStrategy(), "sink": SinkWindowStrategy(sink=4, window=24)}


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


@pytest.fixture(scope="module")
def held(checkpoints) -> TorchVerifier:
    """The llama checkpoint with int4 weights, whose K/V auto holds at bfloat16."""
    return TorchVerifier.load(checkpoints["llama"], device="cpu", dtype="float32", weights="int4")


def _logits(verifier: TorchVerifier, strategy: KVStrategy, tokens: list[int], chunks: list[int]) -> np.ndarray:
    """Logits of every position [T, V] with `tokens` delivered in chunks of these sizes, each committed."""
    cache = verifier.new_cache(strategy)
    rows, start = [], 0
    for size in chunks:
        block = tokens[start : start + size]
        rows.append(verifier.verify(cache, block, len(block)).logits.numpy())
        verifier.commit(cache, len(block))
        start += size
    assert start == len(tokens)
    return np.concatenate(rows)


def test_a_dense_store_rounds_what_it_is_given_to_its_dtype_and_holds_half_the_bytes():
    ops = TorchArrayOps(torch.device("cpu"))
    plain, rounded = DenseLayerStore(ops), DenseLayerStore(ops, dtype=torch.bfloat16)
    keys, values = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    for store in (plain, rounded):
        store.reserve(8)
        store.stage(0, keys, values)
        store.load(np.array([5, 6]), keys[:, :, :2], values[:, :, :2])
    read_keys, read_values = rounded.read(0, 5)
    assert read_keys.dtype == read_values.dtype == torch.bfloat16
    assert torch.equal(read_keys.float(), keys.to(torch.bfloat16).float())
    assert torch.equal(rounded.gather(np.array([5, 6]))[1].float(), values[:, :, :2].to(torch.bfloat16).float())
    assert torch.equal(plain.read(0, 5)[0], keys)  # the model's dtype, untouched
    assert rounded.nbytes * 2 == plain.nbytes


def test_auto_holds_bfloat16_under_8_and_4_bit_weights_on_the_direct_forward_only(checkpoints, held):
    assert held.model_spec.kv_dtype == "bfloat16" and "K/V: bfloat16" in held.description
    for weights in ("float32", "bfloat16"):
        verifier = TorchVerifier.load(checkpoints["llama"], device="cpu", dtype="float32", weights=weights)
        assert verifier.model_spec.kv_dtype == "" and "K/V" not in verifier.description
    library = TorchVerifier.load(checkpoints["llama"], device="cpu", weights="int4", forward="library")
    assert library.model_spec.kv_dtype == ""  # transformers' modules read K/V in the model's dtype
    plain = TorchVerifier.load(checkpoints["llama"], device="cpu", weights="int4", kv_dtype="model")
    assert plain.model_spec.kv_dtype == ""
    asked = TorchVerifier.load(checkpoints["llama"], device="cpu", weights="float32", kv_dtype="bfloat16")
    assert asked.model_spec.kv_dtype == "bfloat16"


def test_bfloat16_is_refused_where_it_cannot_be_held(checkpoints):
    with pytest.raises(ModelLoadError, match="direct forward"):
        TorchVerifier.load(checkpoints["llama"], device="cpu", kv_dtype="bfloat16", forward="library")
    with pytest.raises(ValueError, match="unknown kv_dtype"):
        load_verifier("torch", checkpoints["llama"], device="cpu", kv_dtype="float8")
    with pytest.raises(ValueError, match="torch's"):
        load_verifier("mlx", checkpoints["llama"], device="cpu", kv_dtype="bfloat16")


def test_dense_sessions_hold_bfloat16_and_compressed_ones_their_codecs_forms(held):
    for strategy in (*STRATEGIES.values(), DlmRestoreStrategy(sink=4, window=24)):
        cache = held.new_cache(strategy)
        held.verify(cache, _tokens(0, 6), 1)
        assert {str(array.dtype) for array in cache.arrays()} == {"torch.bfloat16"}
    packed = held.new_cache(FullStrategy(), layer_store=compressor_layer_store("torch", KVCompressor("kakeya_d4", 38)))
    held.verify(packed, _tokens(0, 6), 1)
    held.commit(packed, 6)
    assert "torch.bfloat16" not in {str(array.dtype) for array in packed.arrays()}


def test_a_restoring_session_restores_bfloat16_kv_and_gives_the_values_of_a_full_one(checkpoints, held):
    """Past its window a `dlm_restore` session (the `recompute` plan) restores every evicted position at bfloat16,
    from a prefix forward that reads bfloat16 K/V as the full session's forwards did: the same values, bit for
    bit, however the history arrives."""
    tokens = _tokens(5, 72)
    restoring = DlmRestoreStrategy(sink=4, window=24)
    full = _logits(held, FullStrategy(), tokens, [72])
    for chunks in ([72], [30, 1, 1, 17, 23], [1] * 72):
        np.testing.assert_array_equal(_logits(held, restoring, tokens, chunks), full)
    plain = TorchVerifier.load(checkpoints["llama"], device="cpu", weights="int4", kv_dtype="model")
    restored = []
    for verifier in (held, plain):
        cache = verifier.new_cache(restoring)
        verifier.verify(cache, tokens[:60], 1)
        verifier.commit(cache, 60)
        verifier.verify(cache, tokens[60:], 1)  # restores the 32 evicted positions for this forward
        restored.append(cache.footprint().restored_bytes)
    assert restored[0] > 0 and restored[0] * 2 == restored[1]


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_tokens_values_do_not_depend_on_how_its_history_was_delivered(held, name):
    tokens = _tokens(1, 60)
    whole = _logits(held, STRATEGIES[name], tokens, [60])
    for chunks in ([1] * 60, [7, 1, 1, 13, 2, 36], [30, 30]):
        np.testing.assert_array_equal(_logits(held, STRATEGIES[name], tokens, chunks), whole)


def test_a_batched_forward_gives_each_session_the_values_it_gets_alone(held):
    histories = [_tokens(2, 40), _tokens(3, 17)]
    alone, caches = [], []
    for history in histories:
        cache = held.new_cache(FullStrategy())
        held.verify(cache, history, 1)
        held.commit(cache, len(history))
        caches.append(cache)
        alone.append(held.verify(held.new_cache(FullStrategy()), [*history, 5, 9], 2).logits.numpy())
    outputs = held.verify_batch([BatchBlock(cache, [5, 9], 2) for cache in caches])
    for output, expected in zip(outputs, alone, strict=True):
        np.testing.assert_array_equal(output.logits.numpy(), expected)


def test_bfloat16_kv_stays_close_to_the_models_dtype(checkpoints, held):
    plain = TorchVerifier.load(checkpoints["llama"], device="cpu", weights="int4", kv_dtype="model")
    tokens = _tokens(4, 48)
    rounded, reference = _logits(held, FullStrategy(), tokens, [48]), _logits(plain, FullStrategy(), tokens, [48])
    assert float(np.abs(rounded - reference).max() / np.abs(reference).max()) < 0.02
    assert float((rounded.argmax(-1) == reference.argmax(-1)).mean()) >= 0.95
    assert not np.array_equal(rounded, reference)  # the K/V were rounded: the choice took effect
