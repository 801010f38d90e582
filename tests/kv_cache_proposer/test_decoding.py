"""The decode step: budgets and stops, chunked prefill, speculative accept/commit, invariant checks."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState, StopCause
from kv_cache_proposer.errors import InvariantViolation
from kv_cache_proposer.proposers.base import DraftPolicy
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy, SinkWindowStrategy
from tests.support.backends import BACKENDS, to_numpy
from tests.support.checkpoints import VOCAB_SIZE


def _prompt(n: int = 24) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def _run(decoder: Decoder, seq: SequenceState, params: SamplingParams, budget: GenerationBudget):
    generated, stops, steps = [], None, []
    while stops is None:
        step = decoder.step(seq, params, budget, len(generated))
        steps.append(step)
        generated += step.tokens
        stops = step.stop
    return generated, stops, steps


class ScriptedDraft:
    """Drafts from a fixed script of the continuation, corrupting every third drafted token."""

    max_draft_tokens = 4
    feature_layers = ()
    nbytes = 0

    def __init__(self, script: list[int], prompt_len: int) -> None:
        self.script = script
        self.prompt_len = prompt_len
        self.drafted = 0
        self.requested: list[int] = []

    def propose(self, history: Sequence[int], max_tokens: int) -> list[int]:
        self.requested.append(max_tokens)
        offset = len(history) - self.prompt_len
        draft = list(self.script[offset : offset + max_tokens])
        for i in range(len(draft)):
            self.drafted += 1
            if self.drafted % 3 == 0:
                draft[i] = (draft[i] + 1) % VOCAB_SIZE
        return draft

    def on_commit(self, history: Sequence[int], committed: int, features) -> None:
        return None

    def release(self) -> None:
        return None


def test_max_tokens_stops_the_generation_and_leaves_the_last_token_pending(verifiers):
    decoder = Decoder(verifiers["qwen3"])
    seq = SequenceState(cache=decoder.verifier.new_cache(FullStrategy()), tokens=_prompt())
    tokens, stop, _ = _run(decoder, seq, SamplingParams(), GenerationBudget(max_new_tokens=7))
    assert len(tokens) == 7 and stop is StopCause.MAX_TOKENS
    assert seq.tokens[-7:] == tokens and seq.pending_count == 1


def test_a_stop_token_ends_the_generation_and_is_emitted(verifiers):
    decoder = Decoder(verifiers["qwen3"])
    seq = SequenceState(cache=decoder.verifier.new_cache(FullStrategy()), tokens=_prompt())
    free, _, _ = _run(decoder, seq, SamplingParams(), GenerationBudget(max_new_tokens=10))
    seq = SequenceState(cache=decoder.verifier.new_cache(FullStrategy()), tokens=_prompt())
    stop_token = free[4]
    first = free.index(stop_token)
    tokens, stop, _ = _run(decoder, seq, SamplingParams(), GenerationBudget(10, frozenset({stop_token})))
    assert tokens == free[: first + 1] and stop is StopCause.EOS


def test_the_history_ceiling_stops_with_history_limit(verifiers):
    decoder = Decoder(verifiers["qwen3"])
    seq = SequenceState(cache=decoder.verifier.new_cache(FullStrategy()), tokens=_prompt(24))
    tokens, stop, _ = _run(decoder, seq, SamplingParams(), GenerationBudget(50, max_history_tokens=30))
    assert len(tokens) == 6 and stop is StopCause.HISTORY_LIMIT and len(seq.tokens) == 30


def test_long_pending_history_is_prefilled_in_chunks(verifiers):
    decoder = Decoder(verifiers["qwen3"], prefill_chunk_tokens=10)
    seq = SequenceState(cache=decoder.verifier.new_cache(FullStrategy()), tokens=_prompt(35))
    _, _, steps = _run(decoder, seq, SamplingParams(), GenerationBudget(3))
    assert [s.prefilled for s in steps[:3]] == [10, 10, 10] and [s.tokens for s in steps[:3]] == [[], [], []]
    assert steps[3].prefilled == 4 and len(steps[3].tokens) == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("strategy", [FullStrategy(), SinkWindowStrategy(sink=2, window=8)], ids=["full", "sink"])
@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=0.8, seed=9)], ids=["greedy", "seeded"]
)
@pytest.mark.parametrize("policy", list(DraftPolicy))
def test_speculative_steps_emit_exactly_the_non_speculative_tokens(verifiers, strategy, params, policy):
    verifier = verifiers["llama"]
    prompt = _prompt(24)
    plain = Decoder(verifier)
    reference_seq = SequenceState(cache=verifier.new_cache(strategy), tokens=list(prompt))
    reference, _, _ = _run(plain, reference_seq, params, GenerationBudget(30))

    speculative = Decoder(verifier, draft_policy=policy)
    draft = ScriptedDraft(reference, len(prompt))
    seq = SequenceState(cache=verifier.new_cache(strategy), tokens=list(prompt), draft_session=draft)
    tokens, _, steps = _run(speculative, seq, params, GenerationBudget(30))
    assert tokens == reference
    assert sum(s.accepted for s in steps) > 0 and sum(s.drafted for s in steps) > sum(s.accepted for s in steps)
    assert len(steps) < len(reference)
    assert seq.cache.evicted_count == reference_seq.cache.evicted_count
    for layer in range(verifier.num_layers):
        k1, _, p1 = seq.cache.resident_kv(layer)
        k2, _, p2 = reference_seq.cache.resident_kv(layer)
        assert p1.tolist() == p2.tolist()
        assert np.abs(to_numpy(k1) - to_numpy(k2)).max() < 1e-4


def test_the_draft_policy_sets_how_many_tokens_each_proposal_may_hold(verifiers):
    verifier = verifiers["llama"]
    prompt = _prompt(24)
    reference, _, _ = _run(
        Decoder(verifier),
        SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=list(prompt)),
        SamplingParams(),
        GenerationBudget(30),
    )
    requested = {}
    for policy in DraftPolicy:
        draft = ScriptedDraft(reference, len(prompt))
        seq = SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=list(prompt), draft_session=draft)
        _run(Decoder(verifier, draft_policy=policy), seq, SamplingParams(), GenerationBudget(30))
        requested[policy] = draft.requested
    # full: the whole limit whenever the budget has room for it; adaptive: shorter after rejections.
    assert all(n == 4 for n in requested[DraftPolicy.FULL][:-2])
    assert min(requested[DraftPolicy.ADAPTIVE]) < 4 and requested[DraftPolicy.ADAPTIVE][0] == 4


def test_a_cache_that_moved_backwards_is_an_inv2_violation(verifiers):
    decoder = Decoder(verifiers["qwen3"])
    seq = SequenceState(cache=decoder.verifier.new_cache(FullStrategy()), tokens=_prompt())
    _run(decoder, seq, SamplingParams(), GenerationBudget(3))
    seq.cache._next_position = 0
    with pytest.raises(InvariantViolation) as info:
        decoder.step(seq, SamplingParams(), GenerationBudget(3), 0)
    assert info.value.kind == "inv2"
