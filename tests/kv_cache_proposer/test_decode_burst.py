"""Bursts of plain greedy steps (each step's token fed to the next forward on the device) give exactly the tokens,
stops and cache contents of one step per call, on both backends and every strategy they apply to."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kv_cache_proposer.compression import KVCompressor, compressor_layer_store
from kv_cache_proposer.decoding import (
    Decoder,
    GenerationBudget,
    SequenceState,
    StepRequest,
    StepResult,
    StopCause,
)
from kv_cache_proposer.restoration import LayerSource, RestorationPlan, RestorationSetup
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import DlmRestoreStrategy, FullStrategy, SinkWindowStrategy
from tests.support.backends import BACKENDS, to_numpy
from tests.support.checkpoints import VOCAB_SIZE

pytestmark = pytest.mark.parametrize("backend", BACKENDS)
STRATEGIES = [FullStrategy(), SinkWindowStrategy(sink=2, window=8)]


def _prompt(n: int, seed: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def _run(
    decoder: Decoder, seq: SequenceState, budget: GenerationBudget
) -> tuple[list[int], StopCause, list[StepResult]]:
    generated: list[int] = []
    steps = []
    while not steps or steps[-1].stop is None:
        steps.append(decoder.step(seq, SamplingParams(), budget, len(generated)))
        generated += steps[-1].tokens
    stop = steps[-1].stop
    assert stop is not None
    return generated, stop, steps


@pytest.mark.parametrize("strategy", STRATEGIES, ids=["full", "sink"])
def test_bursts_decode_the_tokens_of_single_steps_and_leave_the_same_cache(verifiers, strategy):
    verifier = verifiers["qwen3"]
    runs = {}
    for burst in (1, 4):
        seq = SequenceState(cache=verifier.new_cache(strategy), tokens=_prompt(20))
        tokens, stop, steps = _run(Decoder(verifier, burst_tokens=burst), seq, GenerationBudget(23))
        runs[burst] = (tokens, stop, steps, seq)
    single, bursts = runs[1], runs[4]
    assert bursts[0] == single[0] and len(single[0]) == 23 and bursts[1] is single[1] is StopCause.MAX_TOKENS
    # The first token comes alone (its latency is never lengthened), then up to 4 per call; 22 = 5 * 4 + 2.
    assert [len(s.tokens) for s in bursts[2]] == [1, 4, 4, 4, 4, 4, 2]
    assert sum(s.forwards for s in bursts[2]) == sum(s.forwards for s in single[2]) == 23
    assert all(s.drafted == 0 for s in bursts[2]), "a burst is not speculation"
    one, four = single[3], bursts[3]
    assert one.committed == four.committed == len(one.tokens) - 1
    assert one.cache.next_position == four.cache.next_position
    for layer in range(one.cache.num_layers):
        (k1, v1), (k4, v4) = one.cache.state[layer], four.cache.state[layer]
        np.testing.assert_allclose(to_numpy(k4), to_numpy(k1), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(to_numpy(v4), to_numpy(v1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=["full", "sink"])
def test_a_stop_token_inside_a_burst_ends_the_generation_there_and_commits_nothing_after_it(verifiers, strategy):
    verifier = verifiers["qwen3"]
    free_seq = SequenceState(cache=verifier.new_cache(strategy), tokens=_prompt(20))
    free, _, _ = _run(Decoder(verifier, burst_tokens=1), free_seq, GenerationBudget(16))
    stop_at = 6  # inside the second burst (tokens 1-4 of the generation)
    stop_token = free[stop_at]
    first = free.index(stop_token)
    seqs = {}
    for burst in (1, 4):
        seq = SequenceState(cache=verifier.new_cache(strategy), tokens=_prompt(20))
        tokens, stop, _ = _run(
            Decoder(verifier, burst_tokens=burst), seq, GenerationBudget(16, frozenset({stop_token}))
        )
        assert tokens == free[: first + 1] and stop is StopCause.EOS
        seqs[burst] = seq
    assert seqs[4].committed == seqs[1].committed == seqs[4].cache.next_position
    assert seqs[4].tokens == seqs[1].tokens


def test_sampling_and_batched_steps_never_burst(verifiers):
    verifier = verifiers["qwen3"]
    decoder = Decoder(verifier, burst_tokens=4)
    seq = SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=_prompt(20))
    sampled = SamplingParams(temperature=0.7, seed=5)
    steps = [decoder.step(seq, sampled, GenerationBudget(8), n) for n in range(4)]
    assert [len(s.tokens) for s in steps] == [1, 1, 1, 1]

    def request(seq: SequenceState) -> StepRequest:
        return StepRequest(seq, SamplingParams(), GenerationBudget(8), 1)

    seqs = [SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=_prompt(20, seed)) for seed in (1, 2)]
    for s in seqs:
        decoder.step(s, SamplingParams(), GenerationBudget(8), 0)
    shared = decoder.step_batch([request(s) for s in seqs])
    assert [len(r.tokens) for r in shared if isinstance(r, StepResult)] == [1, 1], "steps that share a forward"
    (alone,) = decoder.step_batch([request(seqs[0])])
    assert isinstance(alone, StepResult) and len(alone.tokens) == 4, "a step alone in its batch bursts"


@pytest.mark.parametrize("strategy", STRATEGIES, ids=["full", "sink"])
def test_bursts_over_a_compressed_cache_decode_the_tokens_of_single_steps(verifiers, backend, strategy):
    """Inside a burst a step reads the burst's earlier K/V as computed, as a speculative block reads its own; the
    tokens are those of one step per call, and the commit codes the same entries."""
    verifier = verifiers["qwen3"]
    runs = {}
    for burst in (1, 4):
        cache = verifier.new_cache(strategy, layer_store=compressor_layer_store(backend, KVCompressor("kakeya_d4", 38)))
        seq = SequenceState(cache=cache, tokens=_prompt(20))
        tokens, _, steps = _run(Decoder(verifier, burst_tokens=burst), seq, GenerationBudget(23))
        runs[burst] = (tokens, [len(s.tokens) for s in steps], seq)
    assert runs[4][0] == runs[1][0] and len(set(runs[1][0])) > 3
    assert runs[4][1] == [1, 4, 4, 4, 4, 4, 2], "the compressed cache bursts"
    assert runs[4][2].committed == runs[1][2].committed
    assert runs[4][2].cache.nbytes == runs[1][2].cache.nbytes


@pytest.mark.parametrize("compressed", [False, True], ids=["dense", "kakeya_d4"])
@pytest.mark.parametrize("rebuild", ["generation", "step"])
# Exact plans: the first layer's K/V are a function of each token and its position alone (`tokens`).
@pytest.mark.parametrize("kinds", [("recompute",) * 3, ("tokens", "kept", "kept")], ids=["recompute", "tokens"])
def test_a_restoring_cache_bursts_and_names_its_picks_for_rebuilds(verifiers, backend, kinds, rebuild, compressed):
    """A burst over a `dlm_restore` cache evicts as it commits and hands the cache the ids of its picks, from which
    a later rebuild recomputes them: the next turn, rebuilt after a park, gives the tokens of one step per call."""
    verifier = verifiers["qwen3"]
    strategy = DlmRestoreStrategy(sink=2, window=6)
    setup = RestorationSetup(RestorationPlan(tuple(LayerSource(kind) for kind in kinds)), rebuild=rebuild)  # type: ignore[arg-type]
    runs = {}
    for burst in (1, 4):
        store = compressor_layer_store(backend, KVCompressor("kakeya_d4", 38)) if compressed else None
        cache = verifier.new_cache(strategy, restoration=setup, layer_store=store)
        seq = SequenceState(cache=cache, tokens=_prompt(20))
        turns = []
        for turn in range(2):
            tokens, _, steps = _run(Decoder(verifier, burst_tokens=burst), seq, GenerationBudget(11))
            turns.append((tokens, [len(s.tokens) for s in steps]))
            cache.park()
            seq.tokens += _prompt(3, seed=turn)
        runs[burst] = (turns, seq)
    assert [tokens for tokens, _ in runs[4][0]] == [tokens for tokens, _ in runs[1][0]]
    assert len(set(runs[1][0][0][0] + runs[1][0][1][0])) > 3
    assert [lengths for _, lengths in runs[4][0]] == [[1, 4, 4, 2]] * 2, "the restoring cache bursts"
    cache = runs[4][1].cache
    assert cache.evicted_count > 11 and cache.footprint().lost_count == 0
    if not compressed:  # the session that burst holds what one that stepped holds
        assert cache.footprint().nbytes == runs[1][1].cache.footprint().nbytes


def test_a_burst_returns_the_features_of_every_position_it_stages(verifiers, backend):
    # A drafter that declines a draft keeps its context whole when the step bursts: the burst hands back the
    # features of the block and of every pick but the last, as one verify of all of them would.
    verifier = verifiers["qwen3"]
    prompt, layers = _prompt(12), (0, 2)
    picks, features = verifier.burst(verifier.new_cache(FullStrategy()), prompt, 5, feature_layers=layers)
    block = prompt + picks[:-1]
    out = verifier.verify(verifier.new_cache(FullStrategy()), block, 5, feature_layers=layers)
    assert picks == [int(t) for t in np.argmax(to_numpy(out.logits), axis=-1)]
    assert features is not None and to_numpy(features).shape == (len(block), 2 * verifier.hidden_size)
    np.testing.assert_allclose(to_numpy(features), to_numpy(out.features), rtol=1e-4, atol=1e-4)
    assert verifier.burst(verifier.new_cache(FullStrategy()), prompt, 3)[1] is None
