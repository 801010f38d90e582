"""The packed layer store in real sessions, on every backend: what attention reads is what the packed bytes decode
to, speculation changes no token, INV-1 holds, parked sessions hold packed bytes only, sized by the bit budget."""

from __future__ import annotations

import random
import tracemalloc
from functools import partial
from typing import Any

import numpy as np
import pytest

from kv_cache_proposer.compression import KVCompressor, PackedLayerStore, compressor_layer_store
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.proposers.ngram import NgramProposer
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy, SinkWindowStrategy
from tests.support.backends import BACKENDS, to_numpy
from tests.support.checkpoints import VOCAB_SIZE

pytestmark = pytest.mark.parametrize("backend", BACKENDS)

STRATEGIES = [FullStrategy(), SinkWindowStrategy(sink=2, window=10)]
STRATEGY_IDS = ["full", "sink"]
COMPRESSORS = [KVCompressor("kakeya_d4", 38), KVCompressor("kakeya_e8", 10), KVCompressor("kakeya_d4s", 10)]
COMPRESSOR_IDS = ["d4", "e8", "d4s"]


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def _cache(verifier: Any, backend: str, strategy: Any, compressor: KVCompressor) -> Any:
    return verifier.new_cache(strategy, layer_store=compressor_layer_store(backend, compressor))


def _generate(
    verifier: Any, cache: Any, prompt: list[int], new_tokens: int, *, speculate: bool = False, chunk: int = 7
) -> list[int]:
    draft = NgramProposer().open(cache.strategy) if speculate else None
    seq = SequenceState(cache=cache, tokens=list(prompt), **({"draft_session": draft} if draft else {}))
    decoder = Decoder(verifier, prefill_chunk_tokens=chunk)
    budget = GenerationBudget(max_new_tokens=new_tokens)
    generated: list[int] = []
    while len(generated) < new_tokens:
        generated += decoder.step(seq, SamplingParams(), budget, len(generated)).tokens
    return generated[:new_tokens]


def _resident(cache: Any) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    out = []
    for layer in range(cache.num_layers):
        keys, values, positions = cache.resident_kv(layer)
        out.append((to_numpy(keys), to_numpy(values), positions))
    return out


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=COMPRESSOR_IDS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_the_packed_bytes_decode_to_exactly_what_attention_read_while_generating(
    verifiers, backend, strategy, compressor
):
    cache = _cache(verifiers["qwen3"], backend, strategy, compressor)
    _generate(verifiers["qwen3"], cache, _tokens(1, 30), 12)
    working = _resident(cache)  # read from the decoded working copy
    cache.park()
    parked = _resident(cache)  # decoded from the packed codes, escapes included
    for (wk, wv, wp), (pk, pv, pp) in zip(working, parked, strict=True):
        assert np.array_equal(wp, pp)
        assert np.array_equal(wk, pk) and np.array_equal(wv, pv)


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=COMPRESSOR_IDS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_speculative_decoding_with_compression_gives_the_tokens_of_one_token_decoding(
    verifiers, backend, strategy, compressor
):
    verifier = verifiers["qwen3"]
    prompt = _tokens(2, 12) * 3  # repeated text, so prompt lookup drafts and some drafts are accepted
    plain = _generate(verifier, _cache(verifier, backend, strategy, compressor), prompt, 24)
    speculative = _generate(verifier, _cache(verifier, backend, strategy, compressor), prompt, 24, speculate=True)
    assert speculative == plain


@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_a_prompt_prefilled_in_chunks_of_any_size_is_followed_by_the_same_tokens(verifiers, backend, strategy):
    verifier = verifiers["qwen3"]
    compressor = KVCompressor("kakeya_d4", 38)
    prompt = _tokens(13, 40)
    runs = [
        _generate(verifier, _cache(verifier, backend, strategy, compressor), prompt, 16, chunk=chunk)
        for chunk in (1, 6, 40)
    ]
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("name", ["kakeya_d4", "kakeya_d4s"])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_a_parked_session_holds_the_bit_budget_and_no_dense_copy(verifiers, backend, strategy, name):
    compressor = KVCompressor(name, 38)
    verifier = verifiers["qwen3"]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = _cache(verifier, backend, strategy, compressor)
        _generate(verifier, cache, _tokens(3, 40), 9)
        cache.park()
        held_on_host = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert cache.arrays() == []  # no backend array (dense K/V) is left
    resident = cache.resident_count
    layers = cache._layers
    assert all(isinstance(layer, PackedLayerStore) for layer in layers)
    spec = compressor.spec(16)
    rows = 2  # batch 1 x 2 KV heads in the tiny checkpoints
    slots = resident  # full: one slot per position; sink_window: sink + window slots, all occupied
    scales = 2 if name == "kakeya_d4s" else 4  # fp16 qmax alone, or fp16 norm + qmax
    per_layer = 2 * slots * rows * (spec.code_bytes + scales)  # K and V codes and scales
    escapes = sum(layer.packed.escape_keys.nbytes + layer.packed.escape_points.nbytes for layer in layers)
    assert cache.nbytes == cache._slots.nbytes + len(layers) * per_layer + escapes
    assert (
        cache.footprint().escaped_vectors == sum(layer.packed.escape_keys.shape[0] for layer in layers) == 0
    )  # D4: none here
    # The packed arrays live in host memory that numpy reports to tracemalloc: what the cache claims it holds
    # is what was measured (minus small Python objects).
    packed = cache.nbytes - cache._slots.nbytes
    assert packed <= held_on_host <= packed + 64 * 1024
    lattice_bits = spec.blocks * spec.bits_per_block
    assert spec.code_bytes * 8 - lattice_bits < 8  # per vector, at most 7 bits pad the codes to whole bytes


@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_a_compressed_session_holds_fewer_bytes_and_reports_its_dense_equivalent(verifiers, backend, strategy):
    verifier = verifiers["qwen3"]
    dense = verifier.new_cache(strategy)
    packed = _cache(verifier, backend, strategy, KVCompressor("kakeya_d4", 38))
    prompt = _tokens(4, 40)
    for cache in (dense, packed):
        _generate(verifier, cache, prompt, 6)
        cache.park()
    assert packed.footprint().compressed_bytes > 0 and dense.footprint().compressed_bytes == 0
    assert packed.footprint().dense_equivalent_bytes == dense.footprint().dense_equivalent_bytes
    # fp32 tiny models, head_dim 16: 16·4 bytes per vector dense against 13 + 4 packed.
    assert packed.footprint().dense_equivalent_bytes / packed.footprint().compressed_bytes > 3.5


@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_a_parked_session_continues_from_its_packed_bytes_as_if_it_had_never_parked(verifiers, backend, strategy):
    verifier = verifiers["qwen3"]
    compressor = KVCompressor("kakeya_e8", 38)
    prompt = _tokens(5, 25)
    straight = _generate(verifier, _cache(verifier, backend, strategy, compressor), prompt, 16)
    cache = _cache(verifier, backend, strategy, compressor)
    seq = SequenceState(cache=cache, tokens=list(prompt))
    decoder = Decoder(verifier, prefill_chunk_tokens=7)
    generated: list[int] = []
    for parks in range(2):
        budget = GenerationBudget(max_new_tokens=8)
        count = 0
        while count < 8:
            step = decoder.step(seq, SamplingParams(), budget, count)
            generated += step.tokens
            count += len(step.tokens)
        cache.park()
        assert cache.arrays() == [], parks
    assert generated == straight
    cache.check_invariants()


def test_clone_and_state_of_a_compressed_cache_keep_the_packed_entries(verifiers, backend):
    verifier = verifiers["qwen3"]
    cache = _cache(verifier, backend, FullStrategy(), KVCompressor("kakeya_d4", 10))
    _generate(verifier, cache, _tokens(6, 20), 5)
    cache.park()
    twin = cache.clone(cache.next_position)
    for (k1, v1, p1), (k2, v2, p2) in zip(_resident(cache), _resident(twin), strict=True):
        # Re-encoding decoded values can move a code; the twin stays within the codec's own error.
        assert np.array_equal(p1, p2)
        assert np.abs(k1 - k2).max() <= 0.1 * np.abs(k1).max()
        assert np.abs(v1 - v2).max() <= 0.1 * np.abs(v1).max()
    assert twin.footprint().compressed_bytes > 0


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=COMPRESSOR_IDS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_a_fork_copies_the_packed_codes_and_continues_with_the_tokens_of_its_parent(
    verifiers, backend, strategy, compressor
):
    verifier = verifiers["qwen3"]
    parent = _cache(verifier, backend, strategy, compressor)
    prompt = _tokens(6, 30)
    first = _generate(verifier, parent, prompt, 8)
    parent.park()
    history = prompt + first
    fork = parent.clone(parent.next_position)
    fork.park()
    # Byte for byte the same K/V (the slot table may differ by the spare stage slots a parent keeps).
    assert (
        _layer_bytes(fork) == _layer_bytes(parent)
        and fork.footprint().compressed_bytes == parent.footprint().compressed_bytes
    )
    assert fork.footprint().escaped_vectors == parent.footprint().escaped_vectors
    for mine, theirs in zip(fork._layers, parent._layers, strict=True):
        assert np.array_equal(mine.packed.codes, theirs.packed.codes)
        assert np.array_equal(mine.packed.norms, theirs.packed.norms)
        assert np.array_equal(mine.packed.qmax, theirs.packed.qmax)
        assert np.array_equal(mine.packed.escape_keys, theirs.packed.escape_keys)
    # Both continue from the same history; the pending last token is fed to each.
    continued = []
    for cache in (parent, fork):
        seq = SequenceState(cache=cache, tokens=list(history), committed=cache.next_position)
        decoder = Decoder(verifier, prefill_chunk_tokens=7)
        budget = GenerationBudget(max_new_tokens=10)
        out: list[int] = []
        while len(out) < 10:
            out += decoder.step(seq, SamplingParams(), budget, len(out)).tokens
        cache.park()
        continued.append(out[:10])
    assert continued[0] == continued[1]
    assert _layer_bytes(fork) == _layer_bytes(parent)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_a_generating_session_holds_one_form_of_its_history_and_packs_the_same_codes_at_park(
    verifiers, backend, strategy
):
    verifier = verifiers["qwen3"]
    compressor = KVCompressor("kakeya_d4", 38)
    reference = _cache(verifier, backend, strategy, compressor)
    cache = _cache(verifier, backend, strategy, compressor)
    prompt = _tokens(13, 40)
    _generate(verifier, reference, prompt, 9)
    reference.park()
    _generate(verifier, cache, prompt[:20], 1)
    cache.park()  # packed codes, and a second generation that begins from them
    seq = SequenceState(cache=cache, tokens=list(prompt), committed=cache.next_position)
    decoder = Decoder(verifier, prefill_chunk_tokens=7)
    budget = GenerationBudget(max_new_tokens=9)
    count = 0
    while count < 9:
        count += len(decoder.step(seq, SamplingParams(), budget, count).tokens)
    layers = cache._layers
    held = backend == "torch"  # the torch direct forward reads coordinates; MLX keeps a decoded copy and the codes
    assert all(layer.codes_dropped is held for layer in layers)
    generating, footprint = cache.nbytes - cache._slots.nbytes, cache.footprint()
    if held:
        assert all(layer.packed_nbytes == 0 for layer in layers)
        assert generating == footprint.working_bytes  # all it holds is what park frees
        assert footprint.compressed_bytes == sum(layer._work.residents_nbytes for layer in layers)
    else:
        assert generating > footprint.working_bytes  # the codes stay beside the decoded copy
    read_while_generating = _resident(cache)
    cache.park()
    assert not any(layer.codes_dropped for layer in layers) and cache.arrays() == []
    for (wk, wv, wp), (pk, pv, pp) in zip(read_while_generating, _resident(cache), strict=True):
        assert np.array_equal(wp, pp) and np.array_equal(wk, pk) and np.array_equal(wv, pv)
    # The codes packed again from the coordinates are the ones packed as the entries were committed.
    for mine, theirs in zip(layers, reference._layers, strict=True):
        assert np.array_equal(mine.packed.codes, theirs.packed.codes)
        assert np.array_equal(mine.packed.qmax, theirs.packed.qmax)
        assert np.array_equal(mine.packed.norms, theirs.packed.norms)
        assert np.array_equal(mine.packed.escape_keys, theirs.packed.escape_keys)
    assert cache.footprint().compressed_bytes == reference.footprint().compressed_bytes


def test_a_fork_of_a_generating_session_copies_the_codes_its_parent_parks(verifiers, backend):
    verifier = verifiers["qwen3"]
    parent = _cache(verifier, backend, FullStrategy(), KVCompressor("kakeya_d4", 38))
    _generate(verifier, parent, _tokens(14, 30), 6)
    fork = parent.clone(parent.next_position)  # packs the parent's coordinates first
    fork.park()
    parent.park()
    for mine, theirs in zip(fork._layers, parent._layers, strict=True):
        assert np.array_equal(mine.packed.codes, theirs.packed.codes)
        assert np.array_equal(mine.packed.qmax, theirs.packed.qmax)
    assert fork.footprint().compressed_bytes == parent.footprint().compressed_bytes > 0


@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_a_resting_session_keeps_its_coordinates_continues_as_a_parked_one_and_packs_the_same_codes(
    verifiers, backend, strategy
):
    verifier = verifiers["qwen3"]
    compressor = KVCompressor("kakeya_d4", 38)
    prompt = _tokens(15, 30)
    caches = {way: _cache(verifier, backend, strategy, compressor) for way in ("parked", "rested")}
    seqs = {way: SequenceState(cache=cache, tokens=list(prompt)) for way, cache in caches.items()}
    decoder = Decoder(verifier, prefill_chunk_tokens=7)
    generated: dict[str, list[int]] = {way: [] for way in caches}
    for turn in range(2):
        for way in caches:
            budget, count = GenerationBudget(max_new_tokens=8), 0
            while count < 8:
                step = decoder.step(seqs[way], SamplingParams(), budget, count)
                generated[way] += step.tokens
                count += len(step.tokens)
        caches["parked"].park()
        rested = caches["rested"].rest()
        parked, resting = (caches[way].footprint() for way in ("parked", "rested"))
        # The torch direct forward reads coordinates while generating, and they stay; MLX decodes: it parks.
        assert rested is (backend == "torch"), turn
        if rested:
            assert resting.compressed_bytes > parked.compressed_bytes  # int8 coordinates, not packed codes
            assert all(layer.packed_nbytes == 0 for layer in caches["rested"]._layers)
            if strategy.bounded_slots is None:  # no room beyond the positions held, no stage
                assert {int(array.shape[2]) for array in caches["rested"].arrays()} == {caches["rested"].next_position}
        else:
            assert resting == parked
    assert generated["rested"] == generated["parked"]
    fork = caches["rested"].clone(caches["rested"].next_position)  # a fork copies codes: the parent packs
    for cache in (caches["rested"], fork):
        assert cache.footprint().compressed_bytes == caches["parked"].footprint().compressed_bytes
        for mine, theirs in zip(cache._layers, caches["parked"]._layers, strict=True):
            assert np.array_equal(mine.packed.codes, theirs.packed.codes)
            assert np.array_equal(mine.packed.escape_keys, theirs.packed.escape_keys)
    assert caches["rested"].arrays() == [] and not any(layer.codes_dropped for layer in caches["rested"]._layers)


def _layer_bytes(cache: Any) -> int:
    return sum(layer.nbytes for layer in cache._layers)


def test_a_block_staged_again_before_its_commit_replaces_the_codes_staged_first(verifiers, backend):
    verifier = verifiers["qwen3"]
    compressor = KVCompressor("kakeya_d4", 38)
    restaged, direct = (_cache(verifier, backend, FullStrategy(), compressor) for _ in range(2))
    prompt = _tokens(7, 12)
    for cache in (restaged, direct):
        verifier.verify(cache, prompt, 1)
        verifier.commit(cache, len(prompt))
    verifier.verify(restaged, _tokens(8, 5), 1)  # a block that is never committed
    for cache in (restaged, direct):
        verifier.verify(cache, _tokens(9, 3), 1)
        verifier.commit(cache, 3)
        cache.park()
    assert _layer_bytes(restaged) == _layer_bytes(direct)
    for (rk, rv, rp), (dk, dv, dp) in zip(_resident(restaged), _resident(direct), strict=True):
        assert np.array_equal(rp, dp) and np.array_equal(rk, dk) and np.array_equal(rv, dv)


def test_a_query_reads_its_own_kv_as_computed_and_earlier_positions_as_their_codes_decode(verifiers, backend):
    verifier = verifiers["qwen3"]
    cache = _cache(verifier, backend, FullStrategy(), KVCompressor("kakeya_d4", 38))
    verifier.verify(cache, _tokens(10, 6), 1)
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
    cache = _cache(verifier, backend, FullStrategy(), KVCompressor("kakeya_d4", 38))
    verifier.verify(cache, _tokens(11, 9), 1)
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
    verifier.verify(cache, _tokens(12, 1), 1)
    assert starts == [cache.num_layers]  # one pass for every layer, begun once the last layer staged
    for layer in cache._layers:  # and nothing taken yet: the stage still holds the K/V as computed
        keys, values = layer.read(9, 10)
        assert np.array_equal(to_numpy(keys[:, :, 9:10]), to_numpy(layer.pending.keys))
        assert np.array_equal(to_numpy(values[:, :, 9:10]), to_numpy(layer.pending.values))
    verifier.commit(cache, 1)
    assert calls == [cache.num_layers] and starts == [cache.num_layers]
    direct = _cache(verifier, backend, FullStrategy(), KVCompressor("kakeya_d4", 38))
    verifier.verify(direct, _tokens(11, 9) + _tokens(12, 1), 1)
    verifier.commit(direct, 10)
    for (ck, cv, _), (dk, dv, _) in zip(_resident(cache), _resident(direct), strict=True):
        assert np.array_equal(ck[:, :, 9], dk[:, :, 9]) and np.array_equal(cv[:, :, 9], dv[:, :, 9])


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_a_generating_session_holds_its_residents_coded_when_asked_and_the_codec_can(verifiers, backend, arch):
    verifier = verifiers[arch]
    compressor = KVCompressor("kakeya_d4", 38)
    working = {}
    for held in (True, False):
        cache = verifier.new_cache(FullStrategy(), layer_store=compressor_layer_store(backend, compressor, held=held))
        _generate(verifier, cache, _tokens(12, 40), 6)
        working[held] = cache.footprint().working_bytes
        assert _resident(cache), "every layer reads back its residents"
        cache.park()
        assert cache.footprint().working_bytes == 0
    # The torch direct forward (qwen3) reads held coordinates, so the daemon asks for them there
    # (`held=verifier.reads_held_keys`); transformers' modules (gemma3) and MLX read dense K/V.
    assert verifier.reads_held_keys is (backend == "torch" and arch == "qwen3")
    if backend == "torch":
        assert working[True] < working[False]  # int8 coordinates, fp16 scales: a quarter of the decoded copy
    else:
        assert working[True] == working[False]  # MLX's codec is never read held: decoded either way
