"""The drafter-context source of f_θ: the context rows equal the drafter's own, a session keeps them for every
position that can be evicted, a `projected<-drafter` layer is f_θ of them, callers still get the features
they asked for, and speculation changes no token."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.proposers.dflash.checkpoint import load_drafter
from kv_cache_proposer.proposers.ngram import NgramProposer
from kv_cache_proposer.restoration import LayerSource, LinearProjection, RestorationPlan, RestorationSetup, Rotary
from kv_cache_proposer.restoration.drafter_context import DrafterContext
from kv_cache_proposer.restoration.projection import kv_rows
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import DlmRestoreStrategy, FullStrategy
from tests.support.backends import BACKENDS, to_numpy
from tests.support.checkpoints import VOCAB_SIZE, save_dflash_drafter

pytestmark = pytest.mark.parametrize("backend", BACKENDS)

RESTORE = DlmRestoreStrategy(sink=2, window=9)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory: pytest.TempPathFactory):
    return save_dflash_drafter(tmp_path_factory.mktemp("drafter") / "dflash")


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE - 1) for _ in range(n)]


def _plan(context: DrafterContext, seed: int = 0) -> RestorationPlan:
    rng = np.random.default_rng(seed)
    width = 2 * 2 * 16  # K and V of 2 heads x 16
    weight = (rng.normal(size=(context.width, width)) * 0.1).astype(np.float32)
    projection = LinearProjection(weight, np.zeros(width, np.float32))
    layers = (LayerSource("tokens"), LayerSource("projected", projection=projection, from_drafter=True))
    return RestorationPlan((*layers, LayerSource("kept")), drafter=context)


def test_the_context_rows_are_the_drafters_own(verifiers, drafter_dir, backend):
    verifier = verifiers["qwen3"]
    context = DrafterContext.from_drafter(drafter_dir)
    drafter, _ = load_drafter(drafter_dir, device=torch.device("cpu"), dtype=torch.float32)
    cache = verifier.new_cache(FullStrategy())
    features = to_numpy(verifier.verify(cache, _tokens(1, 12), 1, feature_layers=context.target_layer_ids).features)
    with torch.inference_mode():
        expected = drafter.hidden_norm(drafter.fc(torch.from_numpy(features.astype(np.float32)))).numpy()
    np.testing.assert_allclose(context.apply(features), expected, atol=1e-5, rtol=1e-5)


def test_a_drafter_projected_layer_is_f_theta_of_the_context_of_its_positions(verifiers, drafter_dir, backend):
    verifier = verifiers["qwen3"]
    context = DrafterContext.from_drafter(drafter_dir)
    plan = _plan(context)
    tokens = _tokens(2, 24)
    reference = verifier.new_cache(FullStrategy())
    full_features = to_numpy(verifier.verify(reference, tokens[:20], 1, feature_layers=(0, 2)).features)
    cache = verifier.new_cache(RESTORE, restoration=RestorationSetup(plan, rebuild="step"))
    # The first forward sees no eviction: its features, and so the context rows it keeps, are full attention's.
    assert verifier.verify(cache, tokens[:20], 1).features is None  # the caller asked for none
    verifier.commit(cache, 20)
    assert cache.evicted_count == 20 - 11
    verifier.verify(cache, tokens[20:21], 1)  # rebuilt from the kept rows before this forward
    prefix = cache.prefix
    assert prefix is not None
    keys, values = prefix.layer(1)
    rows = plan.layers[1].projection.apply(context.apply(full_features[2:11]))  # type: ignore[union-attr]
    np.testing.assert_allclose(to_numpy(keys)[0].transpose(1, 0, 2).reshape(9, -1), rows[:, :32], atol=1e-4)
    np.testing.assert_allclose(to_numpy(values)[0].transpose(1, 0, 2).reshape(9, -1), rows[:, 32:], atol=1e-4)
    verifier.commit(cache, 1)
    cache.park()
    # Parked: one kept layer per evicted position, plus a context row of every committed position past the sink.
    kept = 10 * 2 * 2 * 16 * 4
    assert cache.footprint().restoration_state_bytes == kept + (21 - 2) * context.width * 4


def test_maps_in_the_unrotated_frame_turn_the_keys_they_write_to_their_positions(verifiers, drafter_dir, backend):
    """A drafter-context map and a map from a kept layer, both in the keys' unrotated frame: the restored keys of
    the evicted positions are the maps' keys turned to those positions (and a kept layer's keys turned back first)."""
    verifier = verifiers["qwen3"]
    context = DrafterContext.from_drafter(drafter_dir)
    rng = np.random.default_rng(5)
    rotary = Rotary((10000.0 ** -(np.arange(0, 16, 2) / 16)).astype(np.float32))
    width = 2 * 2 * 16
    drafted = LinearProjection(
        (rng.normal(size=(context.width, width)) * 0.1).astype(np.float32), np.zeros(width, np.float32), rotary
    )
    between = LinearProjection(
        (rng.normal(size=(width, width)) * 0.3).astype(np.float32), np.zeros(width, np.float32), rotary, True
    )
    layers = (
        LayerSource("projected", projection=drafted, from_drafter=True),
        LayerSource("projected", from_layer=2, projection=between),
        LayerSource("kept"),
    )
    plan = RestorationPlan(layers, drafter=context)
    tokens = _tokens(4, 21)
    reference = verifier.new_cache(FullStrategy())
    full_features = to_numpy(verifier.verify(reference, tokens[:20], 1, feature_layers=(0, 2)).features)
    verifier.commit(reference, 20)
    cache = verifier.new_cache(RESTORE, restoration=RestorationSetup(plan, rebuild="step"))
    verifier.verify(cache, tokens[:20], 1)
    verifier.commit(cache, 20)
    verifier.verify(cache, tokens[20:21], 1)  # rebuilt from the state before this forward
    prefix = cache.prefix
    assert prefix is not None
    positions = np.arange(2, 11)
    full_keys, full_values, _ = reference.resident_kv(2)
    kept_rows = kv_rows(to_numpy(full_keys)[:, :, 2:11], to_numpy(full_values)[:, :, 2:11])
    context_rows = context.apply(full_features[2:11])
    unturned_kept = kept_rows.copy()
    unturned_kept[:, :32] = rotary.turn(kept_rows[:, :32], positions, back=True)
    for layer, unturned in ((0, context_rows @ drafted.weight), (1, unturned_kept @ between.weight)):
        expected = unturned.copy()
        expected[:, :32] = rotary.turn(unturned[:, :32], positions)
        keys, values = prefix.layer(layer)
        got = kv_rows(to_numpy(keys), to_numpy(values))
        np.testing.assert_allclose(got, expected, atol=1e-3)
        assert not np.allclose(got[:, :32], unturned[:, :32], atol=1e-2)  # the keys were turned


def test_the_caller_gets_the_features_it_asked_for_while_the_cache_takes_its_own(verifiers, drafter_dir, backend):
    verifier = verifiers["qwen3"]
    plan = _plan(DrafterContext.from_drafter(drafter_dir))
    tokens = _tokens(3, 15)
    reference = verifier.new_cache(FullStrategy())
    expected = to_numpy(verifier.verify(reference, tokens, 1, feature_layers=(1,)).features)
    cache = verifier.new_cache(RESTORE, restoration=RestorationSetup(plan))
    got = to_numpy(verifier.verify(cache, tokens, 1, feature_layers=(1,)).features)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    verifier.commit(cache, len(tokens))
    assert cache.evicted_count == 4


def test_a_plan_with_a_drafter_source_survives_the_manifest_round_trip(drafter_dir, tmp_path, backend):
    context = DrafterContext.from_drafter(drafter_dir)
    loaded = RestorationPlan.load(_plan(context).save(tmp_path))
    assert loaded.describe() == "L0:tokens, L1:projected<-drafter, L2:kept"
    assert loaded.drafter is not None and loaded.drafter.target_layer_ids == (0, 2)
    np.testing.assert_array_equal(loaded.drafter.fc_weight, context.fc_weight)
    assert loaded.feature_layers == (0, 2)
    with pytest.raises(ValueError, match="carries no drafter context"):
        RestorationPlan(loaded.layers)


def _greedy_turns(verifier: Any, cache: Any, proposer: Any = None) -> list[int]:
    """Three evicting turns of greedy decoding, parking between them as the daemon does."""
    draft = proposer.open(cache.strategy) if proposer is not None else None
    seq = SequenceState(cache=cache, tokens=[], **({"draft_session": draft} if draft is not None else {}))
    decoder = Decoder(verifier, prefill_chunk_tokens=7)
    out: list[int] = []
    for turn, (appended, new_tokens) in enumerate([(30, 6), (5, 5), (17, 6)]):
        seq.tokens.extend(_tokens(40 + turn, appended))
        generated: list[int] = []
        while len(generated) < new_tokens:
            budget = GenerationBudget(max_new_tokens=new_tokens)
            generated += decoder.step(seq, SamplingParams(), budget, len(generated)).tokens
        out += generated
        cache.park()
    return out


def test_speculative_decoding_under_a_drafter_context_plan_gives_the_tokens_of_plain_decoding(
    verifiers, drafter_dir, backend
):
    verifier = verifiers["qwen3"]
    setup = RestorationSetup(_plan(DrafterContext.from_drafter(drafter_dir)))
    plain = _greedy_turns(verifier, verifier.new_cache(RESTORE, restoration=setup))
    speculative = _greedy_turns(
        verifier, verifier.new_cache(RESTORE, restoration=setup), proposer=NgramProposer(lookahead=4)
    )
    assert speculative == plain and len(plain) == 17


def test_a_drafter_context_plan_decodes_one_step_per_forward(verifiers, drafter_dir, backend):
    # Every forward hands the cache the context inputs of the positions it stages; a burst's later steps would
    # not, so this session's greedy steps never burst and each commit finds a context row for every position.
    verifier = verifiers["qwen3"]
    setup = RestorationSetup(_plan(DrafterContext.from_drafter(drafter_dir)))
    cache = verifier.new_cache(RESTORE, restoration=setup)
    seq = SequenceState(cache=cache, tokens=_tokens(5, 30))
    decoder = Decoder(verifier, prefill_chunk_tokens=7, burst_tokens=4)
    lengths = []
    while sum(lengths) < 8:
        lengths.append(len(decoder.step(seq, SamplingParams(), GenerationBudget(8), sum(lengths)).tokens))
    assert lengths == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1] and cache.evicted_count > 0
