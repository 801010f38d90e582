"""The `dlm_restore` session cache on every backend: restored K/V give full attention, the plan's state is what a
parked session holds, invariants are checked, speculation changes nothing."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from kv_cache_proposer.compression import KVCompressor, compressor_layer_store
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.errors import InvariantViolation
from kv_cache_proposer.proposers.ngram import NgramProposer
from kv_cache_proposer.restoration import LayerSource, LinearProjection, RestorationPlan, RestorationSetup
from kv_cache_proposer.restoration.rebuild import forward_kv, prefix_kv
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import DlmRestoreStrategy, FullStrategy
from tests.support.backends import BACKENDS, to_numpy
from tests.support.checkpoints import VOCAB_SIZE

pytestmark = pytest.mark.parametrize("backend", BACKENDS)

RESTORE = DlmRestoreStrategy(sink=2, window=9)
# Turns of (appended tokens, generated tokens): every turn evicts, and prefill chunks of 7 cross the window.
TURNS = [(30, 6), (5, 5), (17, 4), (1, 6)]


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def _converse(verifier: Any, cache: Any, *, proposer: Any = None, seed: int = 0) -> tuple[list[int], SequenceState]:
    """Greedy multi-turn session over `TURNS`; each turn parks the cache as the daemon does between generations."""
    draft = proposer.open(cache.strategy) if proposer is not None else None
    seq = SequenceState(cache=cache, tokens=[], **({"draft_session": draft} if draft is not None else {}))
    decoder = Decoder(verifier, prefill_chunk_tokens=7)
    generated_all: list[int] = []
    for turn, (appended, new_tokens) in enumerate(TURNS):
        seq.tokens.extend(_tokens(seed * 100 + turn, appended))
        budget = GenerationBudget(max_new_tokens=new_tokens)
        generated: list[int] = []
        while len(generated) < new_tokens:
            generated += decoder.step(seq, SamplingParams(), budget, len(generated)).tokens
        generated_all += generated
        cache.park()
    return generated_all, seq


def _plan(*kinds: str, from_layer: int | None = None) -> RestorationPlan:
    return RestorationPlan(
        tuple(LayerSource(kind, from_layer=from_layer if kind == "projected" else None) for kind in kinds)  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("rebuild", ["generation", "step"])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_recompute_gives_the_greedy_tokens_of_full_across_evicting_turns(verifiers, arch, rebuild):
    verifier = verifiers[arch]
    full_tokens, _ = _converse(verifier, verifier.new_cache(FullStrategy()))
    cache = verifier.new_cache(RESTORE, restoration=RestorationSetup(rebuild=rebuild))
    restored_tokens, _ = _converse(verifier, cache)
    assert restored_tokens == full_tokens
    assert cache.evicted_count > 0 and cache.footprint().lost_count == 0
    assert cache.resident_count == RESTORE.sink + RESTORE.window


@pytest.mark.parametrize("plan_kinds", [("recompute",) * 3, ("tokens", "recompute", "recompute"), ("kept",) * 3])
def test_exact_plans_give_the_logits_of_full_attention(verifiers, plan_kinds):
    verifier = verifiers["qwen3"]
    tokens = _tokens(7, 64)
    reference = verifier.new_cache(FullStrategy())
    full_logits = to_numpy(verifier.verify(reference, tokens, len(tokens)).logits)
    cache = verifier.new_cache(RESTORE, restoration=RestorationSetup(_plan(*plan_kinds)))
    rows, start = [], 0
    for size in [12, 1, 1, 20, 5, 25]:
        rows.append(to_numpy(verifier.verify(cache, tokens[start : start + size], size).logits))
        verifier.commit(cache, size)
        start += size
        if size == 20:
            cache.park()  # the next forward rebuilds every restored position from the plan's state
    assert cache.evicted_count == 64 - RESTORE.sink - RESTORE.window
    np.testing.assert_allclose(np.concatenate(rows), full_logits, atol=1e-4, rtol=1e-4)


def test_an_approximate_plan_gives_the_same_logits_whether_rebuilt_per_step_or_per_generation(verifiers):
    verifier = verifiers["llama"]
    tokens = _tokens(9, 60)
    width = 2 * 2 * 16  # a layer's K and V of 2 heads x 16
    weight = np.random.default_rng(3).normal(size=(width, width)).astype(np.float32) * 0.2
    f_theta = LinearProjection(weight, np.zeros(width, np.float32))
    projected = LayerSource("projected", from_layer=1, projection=f_theta)
    plan = RestorationPlan((LayerSource("tokens"), LayerSource("kept"), projected))
    reference = verifier.new_cache(FullStrategy())
    full_logits = to_numpy(verifier.verify(reference, tokens, len(tokens)).logits)
    logits = {}
    for rebuild in ("generation", "step"):
        cache = verifier.new_cache(RESTORE, restoration=RestorationSetup(plan, rebuild=rebuild))
        rows, start = [], 0
        for size in [15, 1, 9, 1, 20, 14]:
            rows.append(to_numpy(verifier.verify(cache, tokens[start : start + size], size).logits))
            verifier.commit(cache, size)
            start += size
        logits[rebuild] = np.concatenate(rows)
    # Bit for bit: per step f_θ maps every evicted position at once, per generation one forward's evictions.
    np.testing.assert_array_equal(logits["generation"], logits["step"])
    # Layer 2 read through layer 1's K/V is an approximation: the logits after the first eviction move.
    assert np.abs(logits["step"][12:] - full_logits[12:]).max() > 1e-3


def test_a_tokens_sourced_first_layer_is_bit_identical_to_full(verifiers):
    verifier = verifiers["qwen3"]
    tokens = _tokens(3, 50)
    reference = verifier.new_cache(FullStrategy())
    verifier.verify(reference, tokens, 1)
    verifier.commit(reference, len(tokens))
    cache = verifier.new_cache(RESTORE, restoration=RestorationSetup(_plan("tokens", "kept", "kept"), rebuild="step"))
    verifier.verify(cache, tokens[:-1], 1)
    verifier.commit(cache, len(tokens) - 1)
    verifier.verify(cache, tokens[-1:], 1)  # rebuilt from the token ids alone before this forward
    prefix = cache.prefix
    assert prefix is not None
    keys, values = prefix.layer(0)
    full_keys, full_values, _ = reference.resident_kv(0)
    np.testing.assert_array_equal(to_numpy(keys), to_numpy(full_keys)[:, :, prefix.positions])
    np.testing.assert_array_equal(to_numpy(values), to_numpy(full_values)[:, :, prefix.positions])


@pytest.mark.parametrize("plan_kinds", [("recompute",) * 3, ("tokens", "kept", "kept")])
def test_speculative_decoding_gives_the_tokens_of_plain_decoding(verifiers, plan_kinds):
    verifier = verifiers["qwen3"]
    setup = RestorationSetup(_plan(*plan_kinds))
    plain, _ = _converse(verifier, verifier.new_cache(RESTORE, restoration=setup), seed=4)
    speculative, _ = _converse(
        verifier, verifier.new_cache(RESTORE, restoration=setup), proposer=NgramProposer(lookahead=4), seed=4
    )
    assert speculative == plain


def test_a_parked_session_holds_resident_kv_and_the_plan_state_only(verifiers):
    verifier = verifiers["qwen3"]
    plan = _plan("tokens", "kept", "projected", from_layer=1)
    cache = verifier.new_cache(RESTORE, restoration=RestorationSetup(plan))
    _, seq = _converse(verifier, cache)
    evicted = cache.evicted_count
    keys, values, _ = cache.resident_kv(1)
    per_position = (to_numpy(keys).nbytes + to_numpy(values).nbytes) // 2 // cache.resident_count  # fp32 model
    assert cache.footprint().restored_bytes == 0 and cache.footprint().restored_count == 0
    assert cache.footprint().peak_restored_bytes >= 3 * evicted * per_position
    # Exactly one kept layer's K/V per evicted position (no growth room), and the token ids reported apart.
    assert cache.footprint().restoration_state_bytes == evicted * per_position
    assert cache.footprint().history_token_bytes == 4 * seq.committed
    assert (
        cache.nbytes
        == cache.resident_bytes + cache.footprint().restoration_state_bytes + cache.footprint().history_token_bytes
    )


def test_trimming_the_kept_layers_at_park_changes_no_token(verifiers):
    verifier = verifiers["qwen3"]
    plan = _plan("tokens", "kept", "projected", from_layer=1)
    trimmed, _ = _converse(verifier, verifier.new_cache(RESTORE, restoration=RestorationSetup(plan)), seed=2)
    never_parked = verifier.new_cache(RESTORE, restoration=RestorationSetup(plan))
    never_parked.park = lambda: None  # type: ignore[method-assign]  # keeps the growth room between turns
    untrimmed, _ = _converse(verifier, never_parked, seed=2)
    assert trimmed == untrimmed


def test_a_plan_kept_compressor_packs_the_kept_layers_of_an_uncompressed_session(verifiers, backend):
    verifier = verifiers["qwen3"]
    plan = _plan("tokens", "kept", "projected", from_layer=1)
    dense = verifier.new_cache(RESTORE, restoration=RestorationSetup(plan))
    kept_store = compressor_layer_store(backend, KVCompressor("kakeya_d4"))
    packed = verifier.new_cache(
        RESTORE, restoration=RestorationSetup(plan.with_kept_compressor("kakeya_d4"), kept_store=kept_store)
    )
    dense_tokens, _ = _converse(verifier, dense, seed=3)
    packed_tokens, _ = _converse(verifier, packed, seed=3)
    assert packed.evicted_count == dense.evicted_count > 0
    assert packed.resident_bytes == dense.resident_bytes  # the resident K/V stay dense
    assert 0 < packed.footprint().restoration_state_bytes < dense.footprint().restoration_state_bytes / 3
    assert len(packed_tokens) == len(dense_tokens)
    # A fork keeps the kept layers packed, with their codes as they are (not decoded and coded again).
    packed.park()
    fork = packed.clone(packed.next_position)
    fork.park()
    assert fork.footprint().restoration_state_bytes == packed.footprint().restoration_state_bytes
    for layer, store in packed._state.kept.items():
        assert np.array_equal(fork._state.kept[layer].packed.codes, store.packed.codes)
        assert np.array_equal(fork._state.kept[layer].packed.qmax, store.packed.qmax)


def test_restored_positions_track_the_evicted_ones_and_positions_never_go_back(verifiers):
    verifier = verifiers["llama"]
    cache = verifier.new_cache(RESTORE, restoration=RestorationSetup(_plan("kept", "kept", "recompute")))
    tokens = _tokens(5, 80)
    last = 0
    for start in range(0, 80, 9):
        verifier.verify(cache, tokens[start : start + 9], 1)
        verifier.commit(cache, min(9, 80 - start))
        assert cache.next_position > last  # INV-2
        last = cache.next_position
        assert cache.footprint().restored_count == cache.evicted_count  # INV-1 of the restored K/V
    assert cache.evicted_count == 80 - 11


def test_kept_state_that_disagrees_with_the_evictions_fails_the_commit(verifiers):
    verifier = verifiers["qwen3"]
    cache = verifier.new_cache(RESTORE, restoration=RestorationSetup(_plan("kept", "kept", "kept")))
    tokens = _tokens(6, 30)
    verifier.verify(cache, tokens[:20], 1)
    verifier.commit(cache, 20)
    cache._state.kept[1].held += 1  # a lost write: layer 1 claims one more evicted position than it holds
    verifier.verify(cache, tokens[20:21], 1)
    with pytest.raises(InvariantViolation):
        verifier.commit(cache, 1)


def test_a_clone_restores_like_the_original(verifiers):
    verifier = verifiers["qwen3"]
    cache = verifier.new_cache(RESTORE, restoration=RestorationSetup(_plan("tokens", "kept", "kept")))
    tokens = _tokens(8, 40)
    verifier.verify(cache, tokens[:39], 1)
    verifier.commit(cache, 39)
    twin = cache.clone(39)
    original = to_numpy(verifier.verify(cache, tokens[39:], 1).logits)
    copied = to_numpy(verifier.verify(twin, tokens[39:], 1).logits)
    np.testing.assert_array_equal(copied, original)
    assert twin.footprint().restoration_state_bytes > 0 and twin.evicted_count == cache.evicted_count


class _BlockSizes:
    """The verifier's `forward_layers`, recording the length of every block a forward reads."""

    def __init__(self, verifier: Any) -> None:
        self._verifier = verifier
        self.sizes: list[int] = []

    def __call__(self, cache: Any, token_ids: Any, last_layer: int) -> None:
        self.sizes.append(len(token_ids))
        self._verifier.forward_layers(cache, token_ids, last_layer)


def test_a_chunked_prefix_forward_gives_the_kv_of_one_forward_over_the_whole_prefix(verifiers):
    verifier = verifiers["qwen3"]
    tokens = _tokens(12, 45)
    positions = np.arange(2, 40, dtype=np.int64)
    whole = forward_kv(verifier.forward_layers, verifier.array_ops, verifier.num_layers, tokens, start=0, last_layer=2)
    spy = _BlockSizes(verifier)
    chunked = prefix_kv(spy, verifier.commit, verifier.array_ops, tokens, positions, last_layer=2, chunk_tokens=7)
    assert spy.sizes == [7] * 6 + [3]
    for layer in range(3):
        for part in (0, 1):
            expected = to_numpy(whole[layer][part])[:, :, positions]
            np.testing.assert_allclose(to_numpy(chunked[layer][part]), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rebuild", ["generation", "step"])
def test_recompute_in_small_chunks_gives_the_greedy_tokens_and_logits_of_full(verifiers, rebuild):
    verifier = verifiers["llama"]
    full_tokens, _ = _converse(verifier, verifier.new_cache(FullStrategy()), seed=5)
    setup = RestorationSetup(rebuild=rebuild, chunk_tokens=5)
    restored_tokens, _ = _converse(verifier, verifier.new_cache(RESTORE, restoration=setup), seed=5)
    assert restored_tokens == full_tokens
    tokens = _tokens(13, 64)
    full_logits = to_numpy(verifier.verify(verifier.new_cache(FullStrategy()), tokens, len(tokens)).logits)
    cache = verifier.new_cache(RESTORE, restoration=setup)
    rows, start = [], 0
    for size in [30, 1, 20, 13]:
        rows.append(to_numpy(verifier.verify(cache, tokens[start : start + size], size).logits))
        verifier.commit(cache, size)
        start += size
        cache.park()  # every forward after this one rebuilds the restored K/V over the prefix, in chunks of 5
    np.testing.assert_allclose(np.concatenate(rows), full_logits, atol=1e-4, rtol=1e-4)


def test_a_negative_rebuild_chunk_is_refused(backend):
    with pytest.raises(ValueError, match="chunk_tokens"):
        RestorationSetup(chunk_tokens=-1)


@pytest.mark.parametrize("chunk_tokens", [0, 1])  # 0: the verifier's prefill chunk; 1: every chunk one token
@pytest.mark.parametrize("rebuild", ["generation", "step"])
def test_a_compressed_session_holds_its_restored_kv_as_coordinates_of_its_own_codec(
    verifiers, backend, rebuild, chunk_tokens
):
    verifier = verifiers["qwen3"]
    packed = compressor_layer_store(backend, KVCompressor("kakeya_d4"), held=verifier.reads_held_keys)
    setup = RestorationSetup(rebuild=rebuild, chunk_tokens=chunk_tokens)
    cache = verifier.new_cache(RESTORE, layer_store=packed, restoration=setup)
    _, seq = _converse(verifier, cache, seed=4)
    if rebuild == "generation":  # a decode step: the rebuild, then the commit adds the position leaving the window
        Decoder(verifier, prefill_chunk_tokens=7).step(seq, SamplingParams(), GenerationBudget(max_new_tokens=1), 0)
    else:
        cache.begin_stage(1, token_ids=[seq.tokens[-1]])  # a forward begins: every evicted position is restored
    prefix, evicted = cache._restored, cache.evicted_count
    assert prefix is not None and prefix.count == evicted > 40
    end = RESTORE.sink + evicted
    positions = np.arange(RESTORE.sink, end, dtype=np.int64)
    exact = prefix_kv(
        verifier.forward_layers,
        verifier.commit,
        verifier.array_ops,
        seq.tokens[:end],
        positions,
        last_layer=verifier.num_layers - 1,
        chunk_tokens=7,
    )
    dense_bytes = sum(to_numpy(array).nbytes // 2 for pair in exact.values() for array in pair)  # float32 model
    if not verifier.reads_held_keys:  # attention reads dense K/V only: the restored K/V stay dense
        assert not prefix.coded and prefix.nbytes >= dense_bytes
        return
    assert prefix.coded
    assert prefix.nbytes < 0.35 * dense_bytes * prefix.capacity / evicted  # per position, growth room included
    assert cache.footprint().restored_bytes == prefix.nbytes
    # Each layer's held K/V are those of the exact history within the codec's error, carried through the layers
    # (the prefix forward of a compressed session reads its coded K/V, as the session's own forwards did).
    for layer in range(verifier.num_layers):
        held = prefix.layer(layer)
        assert not isinstance(held, tuple)
        for got, want in zip(held.dense(), exact[layer], strict=True):
            got, want = to_numpy(got), to_numpy(want)
            assert got.shape == want.shape
            assert np.linalg.norm(got - want) < 0.15 * np.linalg.norm(want)


def test_a_generation_grows_the_restored_kv_no_further_than_it_can_evict(verifiers):
    """After a park the next generation rebuilds the evicted positions' K/V, then each step evicts more of them.
    Growing geometrically, the restored K/V would take room for half the history again at the first eviction; a
    generation of n tokens evicts at most n + 1 more (its pending token too), and that is all the room it takes."""
    verifier = verifiers["qwen3"]
    cache = verifier.new_cache(RESTORE, restoration=RestorationSetup(_plan("recompute", "recompute", "recompute")))
    seq = SequenceState(cache=cache, tokens=_tokens(3, 300))
    decoder = Decoder(verifier, prefill_chunk_tokens=64)

    def generate(count: int) -> list[tuple[int, int]]:
        budget, generated, held = GenerationBudget(max_new_tokens=count), 0, []
        while generated < count:
            generated += len(decoder.step(seq, SamplingParams(), budget, generated).tokens)
            footprint = cache.footprint()
            held.append((footprint.restored_count, footprint.restored_bytes))
        return held

    generate(4)
    cache.park()
    evicted = cache.evicted_count
    per_position = 0  # bytes of one position's K/V in every layer (float32, the test models' dtype)
    for layer in range(3):
        keys = to_numpy(cache.resident_kv(layer)[0])
        per_position += 2 * keys.shape[1] * keys.shape[3] * 4
    held = generate(6)
    assert held[-1][0] > evicted  # the generation evicted more, and they were restored as they left
    assert all(restored_bytes <= (evicted + 1 + 6) * per_position for _, restored_bytes in held)
