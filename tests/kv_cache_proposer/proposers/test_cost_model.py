"""The cost model of speculative decoding as a pure function of its observations: it drafts when drafts are cheap
and accepted, declines when they are costly and rejected, prices what it has not measured, and starts from its
priors. Its probes and refreshes: test_cost_model_probes.py."""

from __future__ import annotations

import pytest

from kv_cache_proposer.proposers.cost_model import (
    MIN_DRAFTS_SEEN,
    PRIOR_ACCEPTANCE,
    DraftCostModel,
    DraftDecision,
)
from tests.support.cost_models import PLAIN_S, measured_model


def test_before_any_measurement_it_drafts_the_whole_limit_then_takes_a_plain_step():
    model = DraftCostModel(6)
    assert model.acceptance == [PRIOR_ACCEPTANCE] * 6
    assert model.decide(6) == (6, DraftDecision.PROBE)
    assert model.decide(3) == (3, DraftDecision.PROBE)  # nothing timed yet: still drafting
    model.observe_draft(6, 2, 0.001)
    model.observe_forward(7, 0.012)
    assert model.decide(6) == (0, DraftDecision.PROBE)  # no plain step timed yet
    model.observe_forward(1, PLAIN_S)
    # Then it drafts the whole limit until it has seen MIN_DRAFTS_SEEN proposals, however the first one went.
    for _ in range(MIN_DRAFTS_SEEN - 1):
        assert model.decide(6) == (6, DraftDecision.PROBE)
        model.observe_draft(6, 0, 0.001)
        model.observe_forward(7, 0.012)
    assert model.decide(6)[1] is not DraftDecision.PROBE


def test_it_declines_when_drafts_are_costly_and_rarely_accepted():
    model = measured_model(draft_s=0.008, verify_s=0.012, accepted=0)
    assert model.decide(4) == (0, DraftDecision.DECLINE)
    assert model.tokens_per_second(0) == pytest.approx(1 / PLAIN_S)


def test_it_drafts_when_drafts_are_cheap_and_accepted():
    model = measured_model(draft_s=0.0005, verify_s=0.011, accepted=4)
    draft_tokens, decision = model.decide(4)
    assert decision is DraftDecision.DRAFT and draft_tokens == 4
    assert model.expected_tokens(4) > 4


def test_it_drafts_the_length_whose_expected_tokens_pay_for_its_cost():
    # Each drafted token costs a forward of a quarter of a plain step; only the first two are ever accepted.
    model = DraftCostModel(6)
    for _ in range(30):
        for k in range(1, 7):
            model.observe_draft(k, min(k, 2), k * PLAIN_S / 4)
            model.observe_forward(k + 1, PLAIN_S)
    model.observe_forward(1, PLAIN_S)
    assert model.decide(6) == (2, DraftDecision.DRAFT)


def test_the_limit_caps_the_draft_and_a_zero_limit_is_a_plain_step():
    model = measured_model(draft_s=0.0005, verify_s=0.011, accepted=4)
    assert model.decide(2) == (2, DraftDecision.DRAFT)
    assert model.decide(0) == (0, DraftDecision.DECLINE)
    assert DraftCostModel(0).decide(8) == (0, DraftDecision.DECLINE)


def test_a_new_session_starts_from_what_the_other_sessionsmeasured_model():
    pool = DraftCostModel(4)
    first = DraftCostModel(4)
    first.join(pool)
    for _ in range(20):  # the first session learns that drafting loses, and the pool with it
        first.observe_draft(4, 0, 0.008)
        first.observe_forward(5, 0.012)
    first.observe_forward(1, PLAIN_S)
    assert pool.decide(4) == (0, DraftDecision.DECLINE)
    # A session that joins before it observed anything declines at once, without drafting to learn it.
    second = DraftCostModel(4)
    second.join(pool)
    assert second.decide(4) == (0, DraftDecision.DECLINE)
    assert second.acceptance == pool.acceptance
    # The pool's estimates weigh no more than its own first few observations: a few cheap, accepted drafts turn
    # its decision (and the pool's, which sees them too).
    for _ in range(6):
        second.observe_draft(4, 4, 0.0005)
        second.observe_forward(5, 0.011)
    assert second.decide(4)[1] is DraftDecision.DRAFT
    assert pool.acceptance == second.acceptance
    # The pool's forward times came from other histories: a session scales them by its own first plain step.
    shorter = measured_model(draft_s=0.008, verify_s=0.012, accepted=0)
    longer = DraftCostModel(4)
    longer.join(shorter)
    longer.observe_forward(1, 2 * PLAIN_S)
    # the draft's time stays the pool's: no history changes it (a windowed drafter's cost is flat)
    assert longer.tokens_per_second(0) == pytest.approx(1 / (2 * PLAIN_S))
    assert longer.tokens_per_second(4) == pytest.approx(longer.expected_tokens(4) / (0.008 + 2 * 0.012))
    # A session that already measured something keeps its own estimates when it joins.
    measured = measured_model(draft_s=0.0005, verify_s=0.011, accepted=4)
    measured.join(pool)
    assert measured.decide(4)[1] is DraftDecision.DRAFT
    with pytest.raises(ValueError):
        DraftCostModel(3).join(pool)


def test_a_position_after_the_accepted_prefix_is_observed_rejected_and_later_ones_take_its_estimate():
    model = DraftCostModel(4)
    model.observe_draft(4, 1, None)
    first, second, third, fourth = model.acceptance
    assert first > PRIOR_ACCEPTANCE > second
    assert third == fourth == second  # never observed: expected to do as the position before them


def test_positions_never_drafted_are_expected_to_do_as_the_last_one_drafted():
    """A session that drafted three tokens whose every draft was accepted expects the fourth to be accepted as
    often, so a longer draft can pay and be tried; one whose drafts were always rejected expects no better."""
    accepted = DraftCostModel(7)
    rejected = DraftCostModel(7)
    for _ in range(10):
        accepted.observe_draft(7, 3, 0.0001, drafted=3)
        rejected.observe_draft(7, 0, 0.0001, drafted=3)
    assert accepted.acceptance[3:] == [accepted.acceptance[2]] * 4 and accepted.acceptance[2] > 0.9
    assert rejected.acceptance[1:] == [rejected.acceptance[0]] * 6 and rejected.acceptance[0] < 0.2
    for model in (accepted, rejected):
        model.observe_forward(4, 0.012)
        model.observe_forward(8, 0.014)
        model.observe_forward(1, PLAIN_S)
    assert accepted.decide(7) == (7, DraftDecision.DRAFT)
    assert rejected.decide(7)[1] is DraftDecision.DECLINE


def test_a_shorter_proposal_is_observed_only_as_far_as_it_drafted_and_an_empty_one_as_a_plain_step():
    """A lookup proposer offers what its match holds, often fewer tokens than asked and often none: positions it
    never offered were not rejected, and an empty proposal costs the proposal and a plain step."""
    model = DraftCostModel(6)
    model.observe_draft(6, 2, 0.0001, drafted=2)  # two offered, both accepted
    first, second, third, *_ = model.acceptance
    assert first > PRIOR_ACCEPTANCE and second > PRIOR_ACCEPTANCE and third == second  # third: never offered
    before, rate_before = model.acceptance, model.expected_tokens(6)
    assert model.offered == 1.0
    model.observe_draft(6, 0, 0.0001, drafted=0)  # no match
    assert model.acceptance == before and model.offered < 1.0
    assert model.expected_tokens(6) - 1 == pytest.approx(model.offered * (rate_before - 1))
    model.observe_forward(3, 0.020)
    model.observe_forward(1, PLAIN_S)
    # an empty proposal's step verifies one token: its cost weighs in by how often proposals are empty
    draft = 0.0001
    expected_s = draft + model.offered * 0.020 + (1 - model.offered) * PLAIN_S
    assert model.tokens_per_second(2) == pytest.approx(model.expected_tokens(2) / expected_s)
    model.observe_draft(6, 1, 0.0001, drafted=3)  # the second offered position rejected, the third not reached
    assert model.acceptance[1] < before[1] and model.acceptance[2] == model.acceptance[1]


def test_slow_proposals_that_are_always_empty_are_declined():
    model = DraftCostModel(4)
    model.observe_forward(1, PLAIN_S)
    for _ in range(MIN_DRAFTS_SEEN + 4):
        draft, _ = model.decide(4)
        model.observe_draft(draft, 0, 0.008, drafted=0)
        model.observe_forward(1, PLAIN_S)
    assert model.offered <= 0.2
    assert model.decide(4) == (0, DraftDecision.DECLINE)


def test_cheap_lookup_drafts_that_are_accepted_when_offered_keep_drafting_among_steps_with_no_match():
    model = DraftCostModel(7)
    model.observe_forward(1, PLAIN_S)
    decisions = []
    for step in range(60):
        draft, _ = model.decide(7)
        offered = 3 if draft and step % 3 == 0 else 0  # a match on one step in three, accepted in full
        model.observe_draft(draft, offered, 0.0001, drafted=offered)
        model.observe_forward(offered + 1, PLAIN_S * (1.1 if offered else 1.0))
        decisions.append(draft)
    assert all(draft >= 3 for draft in decisions), decisions
    draft, decision = model.decide(7)
    assert decision is DraftDecision.DRAFT and draft >= 3


def test_an_unmeasured_length_costs_what_the_nearest_longer_one_costs_or_what_the_measured_line_gives():
    model = DraftCostModel(8)
    model.observe_draft(4, 0, 0.004)
    model.observe_forward(5, 0.014)
    model.observe_forward(1, 0.010)
    expected = model.expected_tokens(2)
    assert model.tokens_per_second(2) == pytest.approx(expected / (0.004 + 0.014))
    # a block of 9: the line through the 1- and 5-token forwards (1 ms a token); one draft length measured: a
    # longer draft is priced at it, the least it can cost
    assert model.tokens_per_second(8) == pytest.approx(model.expected_tokens(8) / (0.004 + 0.018))


def test_with_one_block_length_measured_a_longer_block_is_priced_at_it_not_in_proportion():
    """Bursts time plain steps only: a session that has verified no draft yet prices a block at what a plain step
    costs (on a CPU an 8-token block costs about 1.5 plain steps, not 8), so a good draft is tried and then judged
    on its own time."""
    model = DraftCostModel(7)
    model.observe_forward(1, 0.004, steps=4)
    model.observe_draft(7, 7, 0.0001)
    model.observe_draft(7, 7, 0.0001)
    assert model.tokens_per_second(7) == pytest.approx(model.expected_tokens(7) / (0.0001 + 0.001))


def test_a_longer_draft_priced_by_the_measured_line_is_tried_and_then_judged_on_its_own_time():
    """A session that has verified only one-token drafts does not price a longer block in proportion to its length
    (on a CPU an 8-token block costs about 1.5 single-token ones), so it drafts longer and learns what that costs."""
    model = DraftCostModel(7)
    for _ in range(MIN_DRAFTS_SEEN):
        model.observe_draft(1, 1, 0.00002)
        model.observe_forward(2, 0.011)
    model.observe_forward(1, PLAIN_S)
    for _ in range(MIN_DRAFTS_SEEN):
        model.observe_draft(7, 7, 0.00002, drafted=7)  # lookups that matched in full
    draft, decision = model.decide(7)
    assert decision is DraftDecision.DRAFT and draft == 7
    for _ in range(20):  # but it turns out a long block is dear: the cost model moves to a shorter one
        model.observe_forward(8, 0.080)
    assert model.decide(7)[0] < 7


def test_a_burst_counts_as_plain_steps_of_its_average_time():
    model = DraftCostModel(2)
    model.observe_forward(1, 0.040, steps=8)
    model.observe_draft(2, 0, 0.0)
    model.observe_forward(3, 0.005)
    assert model.tokens_per_second(0) == pytest.approx(1 / 0.005)


def test_invalid_settings_are_rejected():
    with pytest.raises(ValueError):
        DraftCostModel(-1)
    with pytest.raises(ValueError):
        DraftCostModel(4, probe_after_declines=0)
    with pytest.raises(ValueError):
        DraftCostModel(4, probe_share=0)


def test_a_proposal_that_costs_next_to_nothing_is_made_before_the_decision():
    """A lookup (a tenth of a millisecond next to a 10 ms plain step) is looked at first; a model is not."""
    assert measured_model(draft_s=0.0001, verify_s=0.012, accepted=2).peeks(4)
    assert not measured_model(draft_s=0.002, verify_s=0.012, accepted=2).peeks(4)
    assert not DraftCostModel(4).peeks(4)  # nothing measured yet


def test_a_proposal_in_hand_bounds_the_draft_and_an_empty_one_is_a_plain_step():
    """With the proposal in hand the decision drafts no more than it offered, and an empty proposal is a plain step
    (which may run in a burst) where a blind decision would have drafted."""
    model = measured_model(draft_s=0.0001, verify_s=0.011, accepted=4)
    assert model.decide(4) == (4, DraftDecision.DRAFT)
    assert model.decide(4, offered=2) == (2, DraftDecision.DRAFT)
    assert model.decide(4, offered=0) == (0, DraftDecision.DECLINE)


def test_a_step_is_timed_only_when_its_block_held_one_pending_token():
    model = DraftCostModel(4)
    model.observe_step(1, 4, 0, 0, 0, draft_s=None, forward_s=0.008)  # a burst of four plain steps
    assert model.tokens_per_second(0) == pytest.approx(1 / 0.002)
    # A step that also verified three appended tokens: its acceptance counts, its times do not.
    model.observe_step(4, 1, 4, 4, 4, draft_s=0.5, forward_s=0.5)
    assert model.acceptance[0] > PRIOR_ACCEPTANCE
    assert model.tokens_per_second(4) is None  # no proposal timed yet
    model.observe_step(1, 1, 4, 4, 2, draft_s=0.001, forward_s=0.004)
    assert model.tokens_per_second(4) == pytest.approx(model.expected_tokens(4) / 0.005)
    # An empty proposal after an append is not counted as a proposal that offered nothing.
    offered = model.offered
    model.observe_step(3, 1, 4, 0, 0, draft_s=0.001, forward_s=0.004)
    assert model.offered == offered


def test_the_rest_of_a_proposal_cut_short_is_judged_by_the_tokens_generated_after_it():
    pool = DraftCostModel(6)
    model = DraftCostModel(6)
    model.join(pool)
    # A step verified 2 tokens of a 6-token proposal in hand, both accepted; the other 4 stand for positions 100 on.
    model.observe_step(1, 1, 2, 2, 2, draft_s=None, forward_s=None, unverified=[7, 8, 9, 10], position=100)
    before, pooled = model.acceptance, pool.acceptance
    history = [*range(100), 7, 8]
    model.settle(history, len(history))  # two generated, both as offered: the tail is not judged yet
    assert model.acceptance == before
    history.append(5)  # the third differs: positions 3 and 4 would have been accepted, position 5 rejected
    model.settle(history, len(history))
    after = model.acceptance
    assert after[:2] == before[:2]
    assert after[2] > before[2] and after[3] > before[3] and after[4] < before[4]
    assert after[5] == after[4]  # never observed: as the position before it
    assert pool.acceptance != pooled  # the decoder's pool learns it too
    model.settle([*history, 1, 2], len(history) + 2)  # a tail is judged once
    assert model.acceptance == after


def test_a_tail_is_held_only_when_every_verified_draft_was_accepted_and_dropped_once_tokens_are_appended():
    model = DraftCostModel(4)
    # A draft was rejected: the proposal's later positions were never reached, so they say nothing.
    model.observe_step(1, 1, 2, 2, 1, draft_s=None, forward_s=None, unverified=[7, 8], position=10)
    before = model.acceptance
    model.settle([0] * 10 + [7, 8], 12)
    assert model.acceptance == before
    model.observe_step(1, 1, 2, 2, 2, draft_s=None, forward_s=None, unverified=[7, 8], position=10)
    before = model.acceptance
    # Tokens were appended after one generated token: the rest of the tail is never generated, so it is dropped.
    model.settle([0] * 10 + [7], 11, final=True)
    model.settle([0] * 10 + [7, 8], 12)
    assert model.acceptance == before
    # A first generated token that differs judges the tail at once.
    model.observe_step(1, 1, 2, 2, 2, draft_s=None, forward_s=None, unverified=[7, 8], position=10)
    before = model.acceptance
    model.settle([0] * 10 + [3], 11, final=True)
    assert model.acceptance[2] < before[2] and model.acceptance[3] == model.acceptance[2]
