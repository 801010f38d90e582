"""Packed sessions between and across generations, on every backend: a parked session holds packed bytes only,
sized by the bit budget, and continues as if it had never parked; a generating one holds one form of its history; a
resting one keeps its coordinates; forks and clones copy the codes."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from kv_cache_proposer.compression import KVCompressor, PackedLayerStore
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy
from tests.support.backends import BACKENDS
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


@pytest.mark.parametrize("name", ["kakeya_d4", "kakeya_d4s"])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_a_parked_session_holds_the_bit_budget_and_no_dense_copy(verifiers, backend, strategy, name):
    compressor = KVCompressor(name, 38)
    verifier = verifiers["qwen3"]
    # A first generation imports and sets up what it needs once per process: done here, it is not counted as held.
    generate(verifier, packed_cache(verifier, backend, strategy, compressor), tokens(3, 40), 9)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = packed_cache(verifier, backend, strategy, compressor)
        generate(verifier, cache, tokens(3, 40), 9)
        cache.park()
        held_on_host = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert cache.arrays() == []  # no backend array (dense K/V) is left
    residents = cache.resident_count
    layers = cache._layers
    assert all(isinstance(layer, PackedLayerStore) for layer in layers)
    spec = compressor.spec(16)
    rows = 2  # batch 1 x 2 KV heads in the tiny checkpoints
    slots = residents  # full: one slot per position; sink_window: sink + window slots, all occupied
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
    packed = packed_cache(verifier, backend, strategy, KVCompressor("kakeya_d4", 38))
    prompt = tokens(4, 40)
    for cache in (dense, packed):
        generate(verifier, cache, prompt, 6)
        cache.park()
    assert packed.footprint().compressed_bytes > 0 and dense.footprint().compressed_bytes == 0
    assert packed.footprint().dense_equivalent_bytes == dense.footprint().dense_equivalent_bytes
    # fp32 tiny models, head_dim 16: 16·4 bytes per vector dense against 13 + 4 packed.
    assert packed.footprint().dense_equivalent_bytes / packed.footprint().compressed_bytes > 3.5


@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_a_parked_session_continues_from_its_packed_bytes_as_if_it_had_never_parked(verifiers, backend, strategy):
    verifier = verifiers["qwen3"]
    compressor = KVCompressor("kakeya_e8", 38)
    prompt = tokens(5, 25)
    straight = generate(verifier, packed_cache(verifier, backend, strategy, compressor), prompt, 16)
    cache = packed_cache(verifier, backend, strategy, compressor)
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
    cache = packed_cache(verifier, backend, FullStrategy(), KVCompressor("kakeya_d4", 10))
    generate(verifier, cache, tokens(6, 20), 5)
    cache.park()
    twin = cache.clone(cache.next_position)
    for (k1, v1, p1), (k2, v2, p2) in zip(resident(cache), resident(twin), strict=True):
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
    parent = packed_cache(verifier, backend, strategy, compressor)
    prompt = tokens(6, 30)
    first = generate(verifier, parent, prompt, 8)
    parent.park()
    history = prompt + first
    fork = parent.clone(parent.next_position)
    fork.park()
    # Byte for byte the same K/V (the slot table may differ by the spare stage slots a parent keeps).
    assert (
        layer_bytes(fork) == layer_bytes(parent)
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
    assert layer_bytes(fork) == layer_bytes(parent)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=STRATEGY_IDS)
def test_a_generating_session_holds_one_form_of_its_history_and_packs_the_same_codes_at_park(
    verifiers, backend, strategy
):
    verifier = verifiers["qwen3"]
    compressor = KVCompressor("kakeya_d4", 38)
    reference = packed_cache(verifier, backend, strategy, compressor)
    cache = packed_cache(verifier, backend, strategy, compressor)
    prompt = tokens(13, 40)
    generate(verifier, reference, prompt, 9)
    reference.park()
    generate(verifier, cache, prompt[:20], 1)
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
    read_while_generating = resident(cache)
    cache.park()
    assert not any(layer.codes_dropped for layer in layers) and cache.arrays() == []
    for (wk, wv, wp), (pk, pv, pp) in zip(read_while_generating, resident(cache), strict=True):
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
    parent = packed_cache(verifier, backend, FullStrategy(), KVCompressor("kakeya_d4", 38))
    generate(verifier, parent, tokens(14, 30), 6)
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
    prompt = tokens(15, 30)
    caches = {way: packed_cache(verifier, backend, strategy, compressor) for way in ("parked", "rested")}
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
