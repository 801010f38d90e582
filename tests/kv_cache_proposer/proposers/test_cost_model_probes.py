"""The cost model's probes and refreshes: when a declining session drafts again, how long it waits after a probe
that lost, what a probe drafts, and when a drafting session re-times a plain step or a longer block."""

from __future__ import annotations

from kv_cache_proposer.proposers.cost_model import (
    MAX_BACKOFF,
    MAX_PROBE_INTERVAL,
    MIN_DRAFTS_SEEN,
    REFRESH_LONG_AFTER,
    DraftCostModel,
    DraftDecision,
)
from tests.support.cost_models import PLAIN_S, measured_model


def test_after_a_run_of_declines_it_drafts_once_and_follows_acceptance_back_up():
    model = DraftCostModel(4, probe_after_declines=3)
    for _ in range(20):  # a probe costs 5 % more than a plain step: the configured interval holds
        model.observe_draft(4, 0, 0.0001)
        model.observe_forward(5, 0.0104)
    model.observe_forward(1, PLAIN_S)
    assert model.probe_interval(4) == 3
    decisions = [model.decide(4) for _ in range(4)]
    assert [d for _, d in decisions] == [DraftDecision.DECLINE] * 3 + [DraftDecision.PROBE]
    assert decisions[-1][0] > 0
    # The text turned predictable: every probe is accepted whole, and the model drafts again.
    for _ in range(10):
        draft_tokens, _ = model.decide(4)
        if draft_tokens:
            model.observe_draft(draft_tokens, draft_tokens, 0.0001)
            model.observe_forward(draft_tokens + 1, 0.0104)
    assert model.decide(4)[1] is DraftDecision.DRAFT


def test_a_costly_probe_comes_after_enough_plain_steps_to_cost_them_at_most_five_percent():
    # A drafting step costs ten plain steps and is never accepted: probing it every 8 declines would cost about
    # (10 - 1) / 8 = 110 % more than plain decoding; the model waits (10 - 1) / 0.05 = 180 plain steps instead.
    model = measured_model(draft_s=0.050, verify_s=0.050, accepted=0)
    assert model.probe_interval(4) == 180
    decisions = [model.decide(4)[1] for _ in range(181)]
    assert decisions[:180] == [DraftDecision.DECLINE] * 180 and decisions[180] is DraftDecision.PROBE
    # A burst of plain steps is one decision but counts every step: 44 bursts of 4 steps make 176, then 4 more.
    bursting = measured_model(draft_s=0.050, verify_s=0.050, accepted=0)
    for _ in range(45):
        assert bursting.decide(4)[1] is DraftDecision.DECLINE
        bursting.observe_forward(1, 4 * PLAIN_S, steps=4)
    assert bursting.decide(4)[1] is DraftDecision.PROBE
    # However slow drafting gets, it is still probed now and then.
    slow = measured_model(draft_s=5.0, verify_s=0.050, accepted=0)
    assert slow.probe_interval(4) == 512


def _probe(model: DraftCostModel, limit: int, accepted: int) -> int:
    """Decline until the model probes; the probe's proposal is accepted up to `accepted`. The declines it took."""
    declines = 0
    while (decision := model.decide(limit))[1] is DraftDecision.DECLINE:
        declines += 1
    assert decision == (limit, DraftDecision.PROBE)
    model.observe_draft(limit, accepted, 0.008)
    model.observe_forward(limit + 1, 0.012)
    return declines


def test_each_losing_probe_doubles_the_wait_for_the_next_and_a_winning_one_ends_the_wait():
    model = measured_model(draft_s=0.008, verify_s=0.012, accepted=0)
    base = model.probe_interval(4)
    assert base == 20  # a probe costs two plain steps: (2 - 1) / 0.05
    assert [_probe(model, 4, accepted=0) for _ in range(3)] == [base, 2 * base, 4 * base]
    # A probe whose drafts were accepted beyond the estimate: the model drafts again at once, to see whether the
    # text turned predictable; when that one wins too, the next wait is the shortest again.
    _probe(model, 4, accepted=4)
    assert model.probe_interval(4) == base
    assert model.decide(4) == (4, DraftDecision.PROBE)
    model.observe_draft(4, 4, 0.008)
    assert model.probe_interval(4) == base
    for _ in range(MAX_BACKOFF + 4):  # however long drafting keeps losing, it is probed now and then
        model.observe_draft(4, 0, 0.008)
        _probe(model, 4, accepted=0)
    assert model.probe_interval(4) == MAX_PROBE_INTERVAL


def test_a_probe_is_judged_against_what_a_draft_it_offered_is_expected_to_earn():
    """A lookup that offers a draft one step in four: a probe's accepted tokens are compared with what an offered
    draft is expected to earn, not with that figure shrunk by the steps that offer nothing."""
    model = DraftCostModel(4)
    for index in range(20):
        drafted = 4 if index % 4 == 0 else 0  # offered drafts: two accepted, the third rejected
        model.observe_draft(4, min(drafted, 2), 0.008, drafted=drafted)
        model.observe_forward(drafted + 1, 0.012 if drafted else PLAIN_S)
    assert model.offered < 0.25
    assert model.expected_tokens(4) - 1 < 1 < model.expected_accepted(4)
    base = model.probe_interval(4)
    _probe(model, 4, accepted=1)  # above the shrunk figure, below an offered draft's
    assert model.probe_interval(4) == 2 * base  # it lost: no follow-up, and a longer wait
    assert model.decide(4)[1] is DraftDecision.DECLINE
    _probe(model, 4, accepted=4)  # it won: the model drafts again at once
    assert model.decide(4)[0] == 4


def test_a_probe_that_beats_a_near_zero_estimate_but_does_not_pay_for_itself_loses():
    """Drafts that were never accepted: one accepted token beats the estimate, but the probe's step (a 8 ms draft and
    a 12 ms verify) emitted two tokens in the time of two plain steps, no faster: it loses, and the wait doubles.
    Three accepted tokens pay for it: it wins."""
    model = measured_model(draft_s=0.008, verify_s=0.012, accepted=0)
    assert model.expected_accepted(4) < 0.1
    base = model.probe_interval(4)
    _probe(model, 4, accepted=1)
    assert model.probe_interval(4) == 2 * base
    assert model.decide(4)[1] is DraftDecision.DECLINE
    _probe(model, 4, accepted=3)
    assert model.probe_interval(4) == base


def test_a_step_that_verifies_appended_tokens_takes_no_probe_and_does_not_count_towards_one():
    unmeasured = DraftCostModel(4)
    assert unmeasured.decide(4, decoding=False) == (4, DraftDecision.PROBE)  # drafts the limit, as at decode steps
    model = DraftCostModel(4, probe_after_declines=3)
    for _ in range(20):  # a probe costs 5 % more than a plain step: every 3 declines
        model.observe_draft(4, 0, 0.0001)
        model.observe_forward(5, 0.0104)
    model.observe_forward(1, PLAIN_S)
    assert [model.decide(4, decoding=False) for _ in range(10)] == [(0, DraftDecision.DECLINE)] * 10
    assert [model.decide(4)[1] for _ in range(4)] == [DraftDecision.DECLINE] * 3 + [DraftDecision.PROBE]
    cheap = measured_model(draft_s=0.0001, verify_s=0.011, accepted=4)
    assert cheap.decide(4, decoding=False) == (4, DraftDecision.DRAFT)


def test_a_new_session_starts_from_the_probe_wait_of_the_session_that_probed_last():
    """Probes that lost in other sessions are evidence for a new one too: it waits as long as they would before
    its first probe, and a probe that wins anywhere shortens the wait again for the sessions after it."""
    pool = DraftCostModel(4)
    first = DraftCostModel(4)
    first.join(pool)
    for _ in range(20):
        first.observe_draft(4, 0, 0.008)
        first.observe_forward(5, 0.012)
    first.observe_forward(1, PLAIN_S)
    base = first.probe_interval(4)
    _probe(first, 4, accepted=0)
    _probe(first, 4, accepted=0)
    second = DraftCostModel(4)
    second.join(pool)
    second.observe_forward(1, PLAIN_S)
    assert second.probe_interval(4) == 4 * base
    assert _probe(second, 4, accepted=4) == 4 * base  # this one wins
    third = DraftCostModel(4)
    third.join(pool)
    third.observe_forward(1, PLAIN_S)
    assert third.probe_interval(4) == base


def test_after_a_run_of_drafts_it_refreshes_the_time_of_a_plain_step():
    model = DraftCostModel(4, refresh_plain_after=5)
    for _ in range(10):
        model.observe_draft(4, 4, 0.0005)
        model.observe_forward(5, 0.011)
    model.observe_forward(1, PLAIN_S)
    decisions = [model.decide(4) for _ in range(6)]
    assert decisions[:5] == [(4, DraftDecision.DRAFT)] * 5
    assert decisions[5] == (0, DraftDecision.PROBE)
    assert model.decide(4) == (4, DraftDecision.DRAFT)


def test_a_probe_that_falls_due_waits_for_a_proposal_that_offers_something():
    model = measured_model(draft_s=0.0001, verify_s=0.012, accepted=0)
    interval = model.probe_interval(4)
    assert [model.decide(4, offered=0) for _ in range(interval + 3)] == [(0, DraftDecision.DECLINE)] * (interval + 3)
    assert model.decide(4, offered=3) == (3, DraftDecision.PROBE)


def test_a_probe_drafts_the_whole_limit_whatever_length_is_thought_best():
    """Only the first drafted position was ever verified (its acceptance is poor, the others still at their prior):
    a probe drafts every position, so that each is measured."""
    model = DraftCostModel(6)
    for _ in range(20):
        model.observe_draft(1, 0, 0.001)
        model.observe_forward(2, 0.012)
    model.observe_forward(1, PLAIN_S)
    assert model.acceptance[0] < 0.1  # the only position ever observed
    decisions = [model.decide(6) for _ in range(model.probe_interval(6) + 1)]
    assert decisions[-1] == (6, DraftDecision.PROBE)
    assert set(decisions[:-1]) == {(0, DraftDecision.DECLINE)}


def test_a_longer_block_timed_slow_once_is_drafted_again_and_repriced():
    """A lookup's first 8-token block took 30 ms (a cold forward), so three-token drafts look best; after 16 of them
    the session verifies all a proposal offers once, finds the block costs what a short one does, and drafts the
    limit from then. A model's proposal, decided on before it is made, is not so re-timed."""

    def measured() -> DraftCostModel:
        model = DraftCostModel(7)
        for _ in range(MIN_DRAFTS_SEEN):
            model.observe_draft(7, 7, 0.0001)
        model.observe_forward(1, PLAIN_S)
        model.observe_forward(4, 0.011)
        model.observe_forward(8, 0.030)
        return model

    lookup = measured()
    decisions = [lookup.decide(7, offered=7) for _ in range(REFRESH_LONG_AFTER + 1)]
    assert decisions[:-1] == [(3, DraftDecision.DRAFT)] * REFRESH_LONG_AFTER
    assert decisions[-1] == (7, DraftDecision.PROBE)
    for _ in range(4):  # the limit, timed at what it costs when warm
        lookup.observe_forward(8, 0.012)
    assert lookup.decide(7, offered=7) == (7, DraftDecision.DRAFT)
    model = measured()
    assert [model.decide(7) for _ in range(2 * REFRESH_LONG_AFTER)] == [(3, DraftDecision.DRAFT)] * (
        2 * REFRESH_LONG_AFTER
    )
