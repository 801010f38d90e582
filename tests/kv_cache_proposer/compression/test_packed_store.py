"""The packed layer store in real sessions, on every backend: what attention reads is what the packed bytes decode
to, speculation and prefill chunks change no token, a query reads its own K/V as computed, and one-token steps code
every layer in one pass. What sessions hold between generations is in `test_packed_forms`."""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import pytest

from kv_cache_proposer.compression import KVCompressor, compressor_layer_store
from kv_cache_proposer.compression.packed_store import PackedLayerStore
from kv_cache_proposer.errors import InvariantViolation
from kv_cache_proposer.strategies import FullStrategy
from tests.support.backends import BACKENDS, to_numpy
from tests.support.packed_sessions import (
    COMPRESSOR_IDS,
    COMPRESSORS,
    STRATEGIES,
    STRATEGY_IDS,
    generate,
    layer_bytes,
    packed_cache,
    resident,
    tokens,
)

pytestmark = pytest.mark.parametrize("backend", BACKENDS)


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=COMPRESSOR_IDS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_the_packed_bytes_decode_to_exactly_what_attention_read_while_generating(
    verifiers, backend, strategy, compressor
):
    cache = packed_cache(verifiers["qwen3"], backend, strategy, compressor)
    generate(verifiers["qwen3"], cache, tokens(1, 30), 12)
    working = resident(cache)  # read from the decoded working copy
    cache.park()
    parked = resident(cache)  # decoded from the packed codes, escapes included
    for (wk, wv, wp), (pk, pv, pp) in zip(working, parked, strict=True):
        assert np.array_equal(wp, pp)
        assert np.array_equal(wk, pk) and np.array_equal(wv, pv)


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=COMPRESSOR_IDS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_speculative_decoding_with_compression_gives_the_tokens_of_one_token_decoding(
    verifiers, backend, strategy, compressor
):
    verifier = verifiers["qwen3"]
    prompt = tokens(2, 12) * 3  # repeated text, so prompt lookup drafts and some drafts are accepted
    plain = generate(verifier, packed_cache(verifier, backend, strategy, compressor), prompt, 24)
    speculative = generate(verifier, packed_cache(verifier, backend, strategy, compressor), prompt, 24, speculate=True)
    assert speculative == plain


@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_a_prompt_prefilled_in_chunks_of_any_size_is_followed_by_the_same_tokens(verifiers, backend, strategy):
    verifier = verifiers["qwen3"]
    compressor = KVCompressor("kakeya_d4", 38)
    prompt = tokens(13, 40)
    runs = [
        generate(verifier, packed_cache(verifier, backend, strategy, compressor), prompt, 16, chunk=chunk)
        for chunk in (1, 6, 40)
    ]
    assert runs[0] == runs[1] == runs[2]


def test_a_block_staged_again_before_its_commit_replaces_the_codes_staged_first(verifiers, backend):
    verifier = verifiers["qwen3"]
    compressor = KVCompressor("kakeya_d4", 38)
    restaged, direct = (packed_cache(verifier, backend, FullStrategy(), compressor) for _ in range(2))
    prompt = tokens(7, 12)
    for cache in (restaged, direct):
        verifier.verify(cache, prompt, 1)
        verifier.commit(cache, len(prompt))
    verifier.verify(restaged, tokens(8, 5), 1)  # a block that is never committed
    for cache in (restaged, direct):
        verifier.verify(cache, tokens(9, 3), 1)
        verifier.commit(cache, 3)
        cache.park()
    assert layer_bytes(restaged) == layer_bytes(direct)
    for (rk, rv, rp), (dk, dv, dp) in zip(resident(restaged), resident(direct), strict=True):
        assert np.array_equal(rp, dp) and np.array_equal(rk, dk) and np.array_equal(rv, dv)


def test_a_query_reads_its_own_kv_as_computed_and_earlier_positions_as_their_codes_decode(verifiers, backend):
    verifier = verifiers["qwen3"]
    cache = packed_cache(verifier, backend, FullStrategy(), KVCompressor("kakeya_d4", 38))
    verifier.verify(cache, tokens(10, 6), 1)
    verifier.commit(cache, 6)
    seen: list[tuple[np.ndarray, np.ndarray, int, list[int]]] = []
    stage_layer_parts = cache.stage_layer_parts

    def spy(layer_idx: int, keys: Any, values: Any) -> Any:
        parts = stage_layer_parts(layer_idx, keys, values)
        if layer_idx == 0:  # the keys read, joined (a held part as it decodes)
            read = np.concatenate(
                [to_numpy(part[0] if isinstance(part, tuple) else part.dense()[0]) for part in parts], axis=2
            )
            seen.append((to_numpy(keys), read, cache.call.own_keys, cache.call.key_positions.tolist()))
        return parts

    cache.stage_layer_parts = spy
    for block in ([5], [5, 6, 7]):
        verifier.verify(cache, block, 1)
        computed, read, own, key_positions = seen[-1]
        n = len(block)
        if n == 1:  # the one query reads its K as computed, right after the resident entries
            assert own == 0 and read.shape[2] == 7
            assert np.array_equal(read[:, :, 6:], computed)
        else:  # the block as its codes decode (for the later queries), then as computed (each query its own)
            assert own == n and read.shape[2] == 6 + 2 * n
            assert not np.array_equal(read[:, :, 6 : 6 + n], computed)
            assert np.array_equal(read[:, :, 6 + n :], computed)
            assert key_positions == [*range(6 + n), *range(6, 6 + n)]
            verifier.commit(cache, n)
            cache.park()
            assert np.array_equal(to_numpy(cache.resident_kv(0)[0])[:, :, 6:], read[:, :, 6 : 6 + n])
        cache.commit(0)


def test_one_token_steps_code_every_layers_new_kv_in_one_pass_taken_at_the_commit(verifiers, backend):
    verifier = verifiers["qwen3"]
    cache = packed_cache(verifier, backend, FullStrategy(), KVCompressor("kakeya_d4", 38))
    verifier.verify(cache, tokens(11, 9), 1)
    verifier.commit(cache, 9)
    codecs = {id(layer.layout.codec): layer.layout.codec for layer in cache._layers}
    calls: list[int] = []
    starts: list[int] = []

    def counted(original: Any, into: list[int], blocks: Any, dtype: Any) -> Any:
        into.append(len(blocks))
        return original(blocks, dtype)

    for codec in codecs.values():
        codec.code_blocks = partial(counted, codec.code_blocks, calls)
        codec.start_code_blocks = partial(counted, codec.start_code_blocks, starts)
    verifier.verify(cache, tokens(12, 1), 1)
    assert starts == [cache.num_layers]  # one pass for every layer, begun once the last layer staged
    for layer in cache._layers:  # and nothing taken yet: the stage still holds the K/V as computed
        keys, values = layer.read(9, 10)
        assert np.array_equal(to_numpy(keys[:, :, 9:10]), to_numpy(layer.pending.keys))
        assert np.array_equal(to_numpy(values[:, :, 9:10]), to_numpy(layer.pending.values))
    verifier.commit(cache, 1)
    assert calls == [cache.num_layers] and starts == [cache.num_layers]
    direct = packed_cache(verifier, backend, FullStrategy(), KVCompressor("kakeya_d4", 38))
    verifier.verify(direct, tokens(11, 9) + tokens(12, 1), 1)
    verifier.commit(direct, 10)
    for (ck, cv, _), (dk, dv, _) in zip(resident(cache), resident(direct), strict=True):
        assert np.array_equal(ck[:, :, 9], dk[:, :, 9]) and np.array_equal(cv[:, :, 9], dv[:, :, 9])


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_a_generating_session_holds_its_residents_coded_when_asked_and_the_codec_can(verifiers, backend, arch):
    verifier = verifiers[arch]
    compressor = KVCompressor("kakeya_d4", 38)
    working = {}
    for held in (True, False):
        cache = verifier.new_cache(FullStrategy(), layer_store=compressor_layer_store(backend, compressor, held=held))
        generate(verifier, cache, tokens(12, 40), 6)
        working[held] = cache.footprint().working_bytes
        assert resident(cache), "every layer reads back its residents"
        cache.park()
        assert cache.footprint().working_bytes == 0
    # The torch direct forward (qwen3) reads held coordinates, so the daemon asks for them there
    # (`held=verifier.reads_held_keys`); transformers' modules (gemma3) and MLX read dense K/V.
    assert verifier.reads_held_keys is (backend == "torch" and arch == "qwen3")
    if backend == "torch":
        assert working[True] < working[False]  # int8 coordinates, fp16 scales: a quarter of the decoded copy
    else:
        assert working[True] == working[False]  # MLX's codec is never read held: decoded either way


def _prefill_high(verifier: Any, cache: Any, prompt: list[int]) -> tuple[int, int]:
    """What `cache` held as the forward over the second half of `prompt` ended, and after its commit."""
    half = len(prompt) // 2
    verifier.verify(cache, prompt[:half], 1)
    verifier.commit(cache, half)
    verifier.verify(cache, prompt[half:], 1)
    verifier.commit(cache, len(prompt) - half)
    return cache.footprint().forward_bytes, cache.nbytes


def test_a_prefill_chunk_s_dense_stage_goes_once_its_layer_has_attended(verifiers, backend, monkeypatch):
    if backend != "torch":
        pytest.skip("MLX holds a generating packed layer decoded: a block's staged entries are its residents")
    verifier = verifiers["qwen3"]
    compressor = KVCompressor("kakeya_d4", 38)
    prompt = tokens(14, 200)  # blocks of 100: a prefill chunk's stage (beyond the 64 slots kept for decoding)
    bounded = packed_cache(verifier, backend, FullStrategy(), compressor)
    high, kept = _prefill_high(verifier, bounded, prompt)
    with monkeypatch.context() as patched:
        patched.setattr(PackedLayerStore, "stage_read", lambda self: None)
        every_layer = packed_cache(verifier, backend, FullStrategy(), compressor)
        high_before, kept_before = _prefill_high(verifier, every_layer, prompt)
        kept_tokens = generate(
            verifier, packed_cache(verifier, backend, FullStrategy(), compressor), prompt, 6, chunk=100
        )
    assert kept == kept_before
    # Every layer's dense copies of the block, against the last layer's alone (and the block's coding, both).
    assert high - kept < (high_before - kept) / 2
    for (bk, bv, bp), (ek, ev, ep) in zip(resident(bounded), resident(every_layer), strict=True):
        assert np.array_equal(bp, ep) and np.array_equal(bk, ek) and np.array_equal(bv, ev)
    dropped_tokens = generate(
        verifier, packed_cache(verifier, backend, FullStrategy(), compressor), prompt, 6, chunk=100
    )
    assert dropped_tokens == kept_tokens


def test_a_forward_that_extends_a_dropped_prefill_stage_fails_and_one_that_restages_it_runs(verifiers, backend):
    if backend != "torch":
        pytest.skip("MLX holds a generating packed layer decoded: it drops no stage early")
    verifier = verifiers["qwen3"]
    cache = packed_cache(verifier, backend, FullStrategy(), KVCompressor("kakeya_d4", 38))
    with pytest.raises(InvariantViolation, match="dropped"):
        verifier.burst(cache, tokens(15, 100), 2)  # its second forward would read the block's stage
    verifier.verify(cache, tokens(15, 100), 1)  # the same block staged again, from its first slot
    verifier.commit(cache, 100)
    assert cache.next_position == 100
