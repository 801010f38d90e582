"""The `cost` draft policy in the decode step: whatever each session's cost model decides (draft, decline, probe,
bursts of plain steps), the tokens are those of plain decoding, for every proposer and strategy."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import pytest

from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState, StepResult
from kv_cache_proposer.proposers import ProposerOptions, load_proposer
from kv_cache_proposer.proposers.base import DraftPolicy, DraftSession
from kv_cache_proposer.proposers.cost_model import (
    MIN_DRAFTS_SEEN,
    PRIOR_ACCEPTANCE,
    REFRESH_LONG_AFTER,
    DraftCostModel,
    DraftDecision,
)
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy, SinkWindowStrategy
from tests.support.checkpoints import VOCAB_SIZE, save_dflash_drafter, save_draft_model

STRATEGIES = {"full": FullStrategy(), "sink_window": SinkWindowStrategy(sink=2, window=8)}
TOKENS = 36


def _prompt() -> list[int]:
    rng = random.Random(5)
    motif = [rng.randrange(VOCAB_SIZE - 1) for _ in range(6)]
    return motif * 4  # repeated spans, where prompt lookup drafts


def _run(decoder: Decoder, seq: SequenceState) -> tuple[list[int], list[StepResult]]:
    tokens: list[int] = []
    steps: list[StepResult] = []
    while not steps or steps[-1].stop is None:
        steps.append(decoder.step(seq, SamplingParams(), GenerationBudget(TOKENS), len(tokens)))
        tokens += steps[-1].tokens
    return tokens, steps


class SlowDraft:
    """A draft session whose every proposal takes `delay_s` longer, so that drafting costs more than it saves."""

    def __init__(self, inner: DraftSession, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.max_draft_tokens = inner.max_draft_tokens
        self.feature_layers = inner.feature_layers
        self.nbytes = inner.nbytes
        self.proposals = 0

    def propose(self, history: Sequence[int], max_tokens: int) -> list[int]:
        self.proposals += 1
        time.sleep(self.delay_s)
        return self.inner.propose(history, max_tokens)

    def on_commit(self, history: Sequence[int], committed: int, features: Any | None) -> None:
        self.inner.on_commit(history, committed, features)

    def release(self) -> None:
        self.inner.release()

    def clone(self, length: int) -> SlowDraft:
        return SlowDraft(self.inner.clone(length), self.delay_s)


class ContinuationDraft:
    """Drafts the verifier's own continuation (known in advance): free and always accepted."""

    max_draft_tokens = 4
    feature_layers = ()
    nbytes = 0

    def __init__(self, continuation: list[int], prompt_len: int) -> None:
        self.continuation = continuation
        self.prompt_len = prompt_len

    def propose(self, history: Sequence[int], max_tokens: int) -> list[int]:
        offset = len(history) - self.prompt_len
        return list(self.continuation[offset : offset + max_tokens])

    def on_commit(self, history: Sequence[int], committed: int, features: Any | None) -> None:
        return None

    def release(self) -> None:
        return None

    def clone(self, length: int) -> ContinuationDraft:
        return self


class GivenTimes(DraftCostModel):
    """The cost model with the forward times a test gives it: the real forwards' seconds on the test machine (of a
    tiny verifier, about the same for every block length) would decide otherwise."""

    def observe_forward(self, block_tokens: int, seconds: float, steps: int = 1) -> None:
        return None

    def give_forward(self, block_tokens: int, seconds: float) -> None:
        super().observe_forward(block_tokens, seconds)


@pytest.fixture(scope="module")
def proposer_options(tmp_path_factory) -> dict[str, ProposerOptions]:
    root = tmp_path_factory.mktemp("cost_policy")
    return {
        "ngram": ProposerOptions(name="ngram", num_draft_tokens=4, ngram_max_n=3),
        "draft_model": ProposerOptions(name="draft_model", draft_model=save_draft_model(root / "draft")),
        "dflash": ProposerOptions(name="dflash", draft_model=save_dflash_drafter(root / "dflash")),
    }


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("proposer_name", ["ngram", "draft_model", "dflash"])
def test_declining_probing_and_bursting_sessions_emit_exactly_the_plain_tokens(
    verifiers, proposer_options, proposer_name, strategy
):
    verifier = verifiers["qwen3"]
    kv_strategy = STRATEGIES[strategy]
    reference, _ = _run(Decoder(verifier), SequenceState(cache=verifier.new_cache(kv_strategy), tokens=_prompt()))

    proposer = load_proposer(proposer_options[proposer_name], verifier, backend="torch")
    draft = SlowDraft(proposer.open(kv_strategy), delay_s=0.05)
    seq = SequenceState(cache=verifier.new_cache(kv_strategy), tokens=_prompt(), draft_session=draft)
    # probe_share: probes every 3 declines however slow the drafts (a short generation sees several)
    seq.draft_costs = DraftCostModel(draft.max_draft_tokens, probe_after_declines=3, probe_share=1e6)
    tokens, steps = _run(Decoder(verifier, draft_policy=DraftPolicy.COST, burst_tokens=4), seq)

    assert tokens == reference
    decisions = [step.decision for step in steps]
    assert DraftDecision.DECLINE in decisions and DraftDecision.PROBE in decisions
    assert sum(step.drafted for step in steps) > 0
    # Declined steps burst for every proposer: a burst hands a drafter that reads verifier features those of
    # every position it commits, so the drafter drafts on after it (a probe after the bursts drafts again).
    bursts = [index for index, step in enumerate(steps) if step.forwards > 1]
    assert bursts and all(steps[i].decision is not DraftDecision.DRAFT for i in bursts)
    if draft.feature_layers:  # its context stayed whole through the bursts, so its probes still draft
        assert any(step.drafted for step in steps[bursts[0] + 1 :])


def test_a_session_learns_the_acceptance_of_its_drafts_from_the_steps_it_verifies(verifiers):
    verifier = verifiers["llama"]
    prompt = _prompt()
    reference, _ = _run(Decoder(verifier), SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=prompt))
    draft = ContinuationDraft(reference, len(prompt))
    seq = SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=_prompt(), draft_session=draft)
    tokens, steps = _run(Decoder(verifier, draft_policy=DraftPolicy.COST), seq)
    assert tokens == reference
    assert sum(step.accepted for step in steps) > 0
    assert all(rate > PRIOR_ACCEPTANCE for rate in seq.draft_costs.acceptance)


def test_a_decoders_later_session_declines_slow_drafts_from_its_first_step(verifiers, proposer_options):
    verifier = verifiers["llama"]
    proposer = load_proposer(proposer_options["ngram"], verifier, backend="torch")
    decoder = Decoder(verifier, draft_policy=DraftPolicy.COST)

    def run_session() -> tuple[list[int], list[StepResult], SlowDraft]:
        draft = SlowDraft(proposer.open(FullStrategy()), delay_s=0.05)
        seq = SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=_prompt(), draft_session=draft)
        return (*_run(decoder, seq), draft)

    first_tokens, _, first = run_session()
    # The first session drafts until it has measured that drafting loses: its warm-up.
    assert first.proposals >= MIN_DRAFTS_SEEN
    # The next one starts from what the first measured: it proposes nothing (a probe would come only after many
    # more plain steps than this generation takes) and emits the same tokens.
    second_tokens, steps, second = run_session()
    assert second_tokens == first_tokens
    assert second.proposals == 0
    assert {step.decision for step in steps} == {DraftDecision.DECLINE}


def test_the_step_that_verifies_an_append_counts_no_empty_proposal(verifiers, proposer_options):
    """After an append the first step verifies the appended tokens. A drafter that reads features has none for them
    yet and proposes nothing, which says nothing of how often it drafts at a decode step: a session whose
    estimates say drafting pays decides to draft there, and its cost model does not count the empty proposal."""
    verifier = verifiers["qwen3"]
    proposer = load_proposer(proposer_options["dflash"], verifier, backend="torch")
    draft = proposer.open(FullStrategy())
    seq = SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=_prompt(), draft_session=draft)
    limit = draft.max_draft_tokens
    for _ in range(MIN_DRAFTS_SEEN):  # measured: a draft costs half a plain step and is accepted whole
        seq.draft_costs.observe_draft(limit, limit, 0.0005)
        seq.draft_costs.observe_forward(limit + 1, 0.001)
    seq.draft_costs.observe_forward(1, 0.001)
    decoder = Decoder(verifier, draft_policy=DraftPolicy.COST)
    offered, acceptance = seq.draft_costs.offered, seq.draft_costs.acceptance
    step = decoder.step(seq, SamplingParams(), GenerationBudget(TOKENS), 0)  # verifies the prompt
    assert step.prefilled > 0 and step.decision is DraftDecision.DRAFT and step.drafted == 0
    assert (seq.draft_costs.offered, seq.draft_costs.acceptance) == (offered, acceptance)
    # The next step decodes, and the drafter has every feature: it drafts.
    step = decoder.step(seq, SamplingParams(), GenerationBudget(TOKENS), 1)
    assert step.decision is DraftDecision.DRAFT and step.drafted > 0


def test_a_lookup_is_made_before_the_decision_and_a_step_it_offers_nothing_runs_plain(verifiers, proposer_options):
    """Prompt lookup costs next to nothing: the decoder looks first and decides with the proposal in hand. A step
    whose lookup found nothing is a plain step (in a burst), never a step that decided to draft and verified no
    draft; a step whose lookup offered a draft that pays verifies it."""
    verifier = verifiers["qwen3"]
    reference, _ = _run(Decoder(verifier), SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=_prompt()))
    proposer = load_proposer(proposer_options["ngram"], verifier, backend="torch")
    seq = SequenceState(
        cache=verifier.new_cache(FullStrategy()), tokens=_prompt(), draft_session=proposer.open(FullStrategy())
    )
    limit = seq.draft_session.max_draft_tokens
    for _ in range(MIN_DRAFTS_SEEN):  # measured: lookups cost nothing and their drafts are accepted whole
        seq.draft_costs.observe_draft(limit, limit, 1e-7)
        seq.draft_costs.observe_forward(limit + 1, 0.001)
    seq.draft_costs.observe_forward(1, 0.001)
    tokens, steps = _run(Decoder(verifier, draft_policy=DraftPolicy.COST, burst_tokens=4), seq)
    assert tokens == reference
    assert all(step.drafted > 0 for step in steps if step.decision is DraftDecision.DRAFT)
    assert any(step.decision is DraftDecision.DRAFT for step in steps)
    assert any(step.decision is DraftDecision.DECLINE and step.forwards > 1 for step in steps)


def _lookup_session(verifier: Any, accepted: int) -> tuple[list[int], SequenceState, GivenTimes]:
    """The reference greedy tokens, and a session whose lookup drafts exactly them (`ContinuationDraft`) but whose
    cost model measured lookups that cost nothing with only their first `accepted` tokens accepted, and blocks of
    2 and of the whole limit costing 1.2 and 2 plain steps."""
    prompt = _prompt()
    reference, _ = _run(Decoder(verifier), SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=prompt))
    draft = ContinuationDraft(reference, len(prompt))
    seq = SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=_prompt(), draft_session=draft)
    limit = draft.max_draft_tokens
    seq.draft_costs = costs = GivenTimes(limit)
    for _ in range(MIN_DRAFTS_SEEN):
        costs.observe_draft(limit, accepted, 1e-7)
    for block, seconds in ((1, 0.001), (2, 0.0012), (limit + 1, 0.002)):
        costs.give_forward(block, seconds)
    return reference, seq, costs


def test_a_session_that_verifies_a_lookup_short_learns_the_rest_from_the_tokens_it_generates(verifiers):
    """Longer blocks cost more here, and the session has seen only the first drafted token accepted, so it verifies
    one token of each proposal in hand. The rest of every proposal is judged by the tokens the session goes on to
    generate (each is the verifier's own), so it learns that longer drafts pay and verifies whole proposals long
    before a refresh would have made it try one."""
    verifier = verifiers["qwen3"]
    reference, seq, costs = _lookup_session(verifier, accepted=1)
    tokens, steps = _run(Decoder(verifier, draft_policy=DraftPolicy.COST), seq)
    assert tokens == reference
    assert steps[1].decision is DraftDecision.DRAFT and steps[1].drafted == 1
    longer = next(index for index, step in enumerate(steps) if step.drafted > 1)
    assert steps[longer].decision is DraftDecision.DRAFT and steps[longer].drafted == costs.max_draft_tokens
    assert longer < REFRESH_LONG_AFTER


def test_a_session_that_declines_a_lookup_learns_from_what_it_generates_and_drafts_again_without_a_probe(verifiers):
    """A session whose lookups were all rejected declines them, with each proposal in hand. The tokens it generates
    in plain steps (bursts included) judge those proposals, so once the text turns predictable it drafts again on
    its estimates, where before only a probe, many plain steps later, could have told it."""
    verifier = verifiers["qwen3"]
    reference, seq, costs = _lookup_session(verifier, accepted=0)
    limit = costs.max_draft_tokens
    assert costs.tokens_per_second(1, offered=True) < costs.tokens_per_second(0)  # so it declines
    tokens, steps = _run(Decoder(verifier, draft_policy=DraftPolicy.COST, burst_tokens=4), seq)
    assert tokens == reference
    first = next(index for index, step in enumerate(steps) if step.drafted)
    assert all(step.decision is DraftDecision.DECLINE for step in steps[:first])
    assert steps[first].decision is DraftDecision.DRAFT  # not a probe
    assert 0 < steps[first].drafted <= limit


class TimedForwards(DraftCostModel):
    """The cost model, recording the forwards it is given to time."""

    def __init__(self, max_draft_tokens: int) -> None:
        super().__init__(max_draft_tokens)
        self.timed: list[tuple[int, float]] = []

    def observe_forward(self, block_tokens: int, seconds: float, steps: int = 1) -> None:
        self.timed.append((block_tokens, seconds))
        super().observe_forward(block_tokens, seconds, steps)


def test_a_generations_first_forward_prices_no_step(verifiers, proposer_options, monkeypatch):
    """The first forward of a generation also does what a session's first forward after a pause does (a compressed
    session reads its parked codes back): priced by it, a plain step would look many times dearer than it is, and
    so would every block borrowed from the daemon's other sessions with it. The next forwards are decode steps and
    timed."""
    verifier = verifiers["llama"]
    proposer = load_proposer(proposer_options["ngram"], verifier, backend="torch")
    seq = SequenceState(
        cache=verifier.new_cache(FullStrategy()), tokens=_prompt(), draft_session=proposer.open(FullStrategy())
    )
    decoder = Decoder(verifier, draft_policy=DraftPolicy.COST, burst_tokens=4)
    _run(decoder, seq)  # a first generation
    assert seq.pending_count == 1
    seq.draft_costs = costs = TimedForwards(seq.draft_session.max_draft_tokens)

    def slowed(forward: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.2)
            return forward(*args, **kwargs)

        return run

    monkeypatch.setattr(verifier, "verify", slowed(verifier.verify))
    monkeypatch.setattr(verifier, "burst", slowed(verifier.burst))
    budget = GenerationBudget(TOKENS)
    first = decoder.step(seq, SamplingParams(), budget, 0)  # the next generation's first step
    assert first.tokens and costs.timed == []
    decoder.step(seq, SamplingParams(), budget, len(first.tokens))
    assert len(costs.timed) == 1 and costs.timed[0][1] >= 0.2
