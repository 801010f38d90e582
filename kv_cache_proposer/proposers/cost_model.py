"""A per-session cost model of speculative decoding: whether the next step drafts, and how many tokens.

It keeps exponentially weighted averages of the session's acceptance per drafted position and of the seconds of a
proposal and of a forward per block length, and picks the draft length k (0: a plain step) that maximises the
expected tokens per second, E[tokens | k] / (t_draft(k) + t_forward(k + 1)); it keeps probing both arms. Every
decision is a deterministic function of the observations. The sessions of one decoder pool what they observe
(`join`), so a new session starts from what the others measured. The rules (priors, probes, refreshes, the pool)
are in docs/speculative-decoding.md ("Draft length").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

PRIOR_ACCEPTANCE = 0.5  # counts as one observation: the first real one moves an estimate halfway
# weight of the newest observation in the acceptance averages, once 1 / (observations + 1) is less
ACCEPTANCE_WEIGHT = 0.2
TIME_WEIGHT = 0.25  # weight of the newest observation in the time averages
MIN_DRAFTS_SEEN = 4  # proposals a session observes before it may decline drafting
PROBE_SHARE = 0.05  # most that probes add, in expectation, to the time of the plain steps between them
MAX_PROBE_INTERVAL = 512  # plain steps between probes, at most
MAX_BACKOFF = 6  # a probe that loses doubles the wait for the next, at most this many times in a row
REFRESH_LONG_AFTER = 16  # steps drafting less of a proposal in hand than it offered, before one drafts it all
PEEK_SHARE = 0.05  # a proposal that costs at most this share of a plain step is made before deciding (`peeks`)
MAX_HELD = 8  # unverified tails of proposals in hand awaiting the tokens that judge them (`settle`)


class DraftDecision(StrEnum):
    """What the cost model chose for a step: `draft` (drafting is expected faster), `decline` (a plain step is
    expected faster) or `probe` (the other arm, taken to refresh its estimate)."""

    DRAFT = "draft"
    DECLINE = "decline"
    PROBE = "probe"


class DraftCostModel:
    """One session's estimates of acceptance and step times, and the draft length they make fastest."""

    def __init__(
        self,
        max_draft_tokens: int,
        *,
        probe_after_declines: int = 8,
        refresh_plain_after: int = 64,
        probe_share: float = PROBE_SHARE,
    ) -> None:
        if max_draft_tokens < 0 or probe_after_declines < 1 or refresh_plain_after < 1:
            raise ValueError("max_draft_tokens must be >= 0, probe_after_declines and refresh_plain_after >= 1")
        if probe_share <= 0:
            raise ValueError("probe_share must be > 0")
        self.max_draft_tokens = max_draft_tokens
        self.probe_after_declines = probe_after_declines
        self.probe_share = probe_share
        self.refresh_plain_after = refresh_plain_after
        self._acceptance = [PRIOR_ACCEPTANCE] * max_draft_tokens  # [i]: position i + 1, given positions <= i
        self._seen = [0] * max_draft_tokens  # observations of each position
        self._offered = 1.0  # the share of proposals that offered a draft (a lookup may find nothing)
        self._draft_s: dict[int, float] = {}  # requested draft length -> seconds of a proposal
        self._forward_s: dict[int, float] = {}  # block length -> seconds of a verifier forward
        self._plain_streak = 0
        self._draft_streak = 0
        self._short_streak = 0  # drafting steps in a row that drafted less than they could
        self._drafts_seen = 0  # proposals observed, empty ones included
        self._follow_up = False  # the last probe beat the estimate: draft again before judging
        self._probing = False  # the pending proposal is a probe taken while declining
        self._backoff = 0  # probes in a row that lost: each doubles the wait for the next
        self._pool: DraftCostModel | None = None
        self._borrowed: set[int] = set()  # block lengths whose forward time is the pool's, not yet measured here
        self._held: list[tuple[int, int, list[int]]] = []  # (position, verified, tail) of proposals cut short

    def join(self, pool: DraftCostModel) -> None:
        """Share observations with `pool`, the model of every session of one decoder: a model that has observed
        nothing yet starts from the pool's estimates (its acceptance counting as at most `MIN_DRAFTS_SEEN`
        observations, so its own soon outweigh them; the forward times scaled by its own first plain step, since
        a forward's time grows with the history and the pool's came from other histories) and from the probe
        wait of the session that probed last (probes that lost elsewhere are evidence here too), and every later
        observation updates both."""
        if pool is self._pool or pool is self:
            return
        if pool.max_draft_tokens != self.max_draft_tokens:
            raise ValueError("a pool takes models of its own draft limit only")
        if not self._drafts_seen and not self._forward_s:
            self._acceptance = list(pool._acceptance)
            self._seen = [min(seen, MIN_DRAFTS_SEEN) for seen in pool._seen]
            self._offered = pool._offered
            self._draft_s, self._forward_s = dict(pool._draft_s), dict(pool._forward_s)
            self._borrowed = set(self._forward_s)
            self._drafts_seen = min(pool._drafts_seen, MIN_DRAFTS_SEEN)
            self._backoff = pool._backoff
        self._pool = pool

    @property
    def acceptance(self) -> list[float]:
        """The estimated acceptance of each drafted position, given that every earlier one was accepted (for a
        position never observed, that of the position before it)."""
        return list(self._acceptance)

    @property
    def offered(self) -> float:
        """The estimated share of proposals that offer a draft at all."""
        return self._offered

    def expected_tokens(self, draft_tokens: int, *, offered: bool = False) -> float:
        """Tokens a step that drafts `draft_tokens` is expected to emit (its accepted drafts plus one), an empty
        proposal's plain step included (`offered`: a proposal in hand that offered them, so none is empty)."""
        return 1.0 + (1.0 if offered else self._offered) * self.expected_accepted(draft_tokens)

    def expected_accepted(self, drafted: int) -> float:
        """Drafted tokens the verifier is expected to accept of a proposal that offered `drafted` of them."""
        accepted, reach = 0.0, 1.0
        for rate in self._acceptance[:drafted]:
            reach *= rate
            accepted += reach
        return accepted

    def tokens_per_second(self, draft_tokens: int, *, offered: bool = False) -> float | None:
        """The expected rate of a step that drafts `draft_tokens` (0: a plain step); None until one is timed.
        `offered`: of a step whose proposal is in hand and offered that many tokens (no empty proposal to allow
        for)."""
        forward = _estimate(self._forward_s, draft_tokens + 1)
        if forward is None:
            return None
        draft = 0.0
        if draft_tokens > 0:
            measured = _estimate(self._draft_s, draft_tokens)
            if measured is None:
                return None
            share = 1.0 if offered else self._offered
            plain = self._forward_s.get(1, forward)  # what a step whose proposal was empty verifies
            draft, forward = measured, share * forward + (1 - share) * plain
        return self.expected_tokens(draft_tokens, offered=offered) / max(draft + forward, 1e-12)

    def peeks(self, limit: int) -> bool:
        """Whether the decoder should propose before deciding, and decide with the proposal in hand
        (`decide(offered=...)`): once measured, a proposal of `limit` tokens costs at most `PEEK_SHARE` of a plain
        step (a lookup, not a model). An empty proposal then costs a plain step nothing (it may still run in a
        burst), and a draft is judged by what a proposal that offered it earns."""
        plain = self._forward_s.get(1)
        draft = _estimate(self._draft_s, min(limit, self.max_draft_tokens))
        return (
            self._drafts_seen >= MIN_DRAFTS_SEEN
            and plain is not None
            and draft is not None
            and draft <= PEEK_SHARE * plain
        )

    def decide(self, limit: int, *, decoding: bool = True, offered: int | None = None) -> tuple[int, DraftDecision]:
        """The draft length of the next step, at most `limit` (0: a plain step), and why; counts the decision
        towards the next probe. `decoding=False`: a step that also verifies appended tokens, which is not counted
        and takes no probe: the estimates alone decide it (before they are measured, it drafts the limit).
        `offered`: the proposal is in hand (`peeks`) and offered that many tokens; an empty one is a plain step
        (a probe that falls due waits for a proposal that offers something)."""
        given = offered is not None
        limit = min(limit, self.max_draft_tokens, limit if offered is None else offered)
        if limit < 1:  # an empty proposal in hand is a plain decode step, and counts as one
            return self._count(0, DraftDecision.DECLINE) if decoding and given else (0, DraftDecision.DECLINE)
        if not decoding:
            if not self._draft_s or 1 not in self._forward_s or self._drafts_seen < MIN_DRAFTS_SEEN:
                return limit, DraftDecision.PROBE  # not yet measured: the whole limit, as a decode step drafts
            best_draft, pays = self._fastest(limit, offered=given)
            return (best_draft, DraftDecision.DRAFT) if pays else (0, DraftDecision.DECLINE)
        if not self._draft_s:
            return self._count(limit, DraftDecision.PROBE)
        if 1 not in self._forward_s:
            return self._count(0, DraftDecision.PROBE)
        if self._drafts_seen < MIN_DRAFTS_SEEN:  # one unlucky draft is no evidence against drafting
            return self._count(limit, DraftDecision.PROBE)
        follow_up, self._follow_up = self._follow_up, False
        best_draft, pays = self._fastest(limit, offered=given)
        if pays:
            self._backoff = 0
            if self._draft_streak >= self.refresh_plain_after:
                return self._count(0, DraftDecision.PROBE)
            if given and best_draft < limit and self._short_streak >= REFRESH_LONG_AFTER:
                # Re-time the longest block and the deeper positions of a lookup's proposal in hand (a model's
                # longer draft costs more than this is worth): a length drafted once and timed slow (its first
                # forward) would otherwise keep its price for good.
                self._short_streak = 0
                return self._count(limit, DraftDecision.PROBE)
            self._short_streak = self._short_streak + 1 if given and best_draft < limit else 0
            return self._count(best_draft, DraftDecision.DRAFT)
        # A probe drafts the whole limit: it measures the acceptance of every position, and the forward of the
        # longest block, where a probe of the length now thought best would leave the others at their priors.
        if follow_up or self._plain_streak >= self.probe_interval(limit):
            self._probing = True
            return self._count(limit, DraftDecision.PROBE)
        return self._count(0, DraftDecision.DECLINE)

    def _fastest(self, limit: int, *, offered: bool = False) -> tuple[int, bool]:
        """The draft length of at most `limit` expected fastest, and whether it beats a plain step."""
        rates = [self.tokens_per_second(k, offered=offered) or 0.0 for k in range(limit + 1)]
        best_draft = max(range(1, limit + 1), key=lambda k: (rates[k], -k))
        return best_draft, rates[best_draft] > rates[0]

    def probe_interval(self, draft_tokens: int) -> int:
        """Plain steps in a row before a probe drafting `draft_tokens`: `probe_after_declines`, or more when that
        probe costs more than a plain step by over `probe_share` (default `PROBE_SHARE`) per plain step; doubled
        for every probe in a row that did not beat its estimate (at most `MAX_PROBE_INTERVAL`)."""
        plain = _estimate(self._forward_s, 1)
        draft = _estimate(self._draft_s, draft_tokens)
        verify = _estimate(self._forward_s, draft_tokens + 1)
        interval = self.probe_after_declines
        if plain is not None and draft is not None and verify is not None and plain > 0:
            extra = (draft + verify) / plain - 1
            interval = max(interval, math.ceil(extra / self.probe_share))
        return min(MAX_PROBE_INTERVAL, interval << self._backoff)

    def observe_draft(
        self, requested: int, accepted: int, seconds: float | None, *, drafted: int | None = None
    ) -> None:
        """A proposal asked for `requested` tokens and gave `drafted` (None: as many), of which the verifier accepted
        the first `accepted`; `seconds`: the time of the proposal (None: not timed). Only drafted positions are
        observed: a proposer that offers fewer tokens, or none (a lookup that found no match), has not been
        rejected beyond what it offered; how often it offers nothing is estimated apart (`offered`), since such a
        step costs the proposal and a plain step."""
        if self._pool is not None:
            self._pool.observe_draft(requested, accepted, seconds, drafted=drafted)
        drafted = requested if drafted is None else min(drafted, requested)
        expected = self.expected_accepted(drafted)
        self._observe_positions(0, drafted, accepted)
        if requested > 0:
            self._drafts_seen += 1
            weight = max(ACCEPTANCE_WEIGHT, 1 / (self._drafts_seen + 1))
            self._offered += weight * ((1.0 if drafted else 0.0) - self._offered)
            # A probe taken while declining that beat the estimate (of a proposal that offered as many tokens as it
            # did) and paid for itself: the text may have turned predictable. One that did not makes the next wait
            # longer (a drafter whose estimate is near nothing beats it with one token, and still loses time).
            probing, self._probing = self._probing, False
            self._follow_up = probing and accepted > expected and self._paid(requested, drafted, accepted)
            if probing:
                self._backoff = 0 if self._follow_up else min(self._backoff + 1, MAX_BACKOFF)
                if self._pool is not None:  # the wait a session that joins next starts from
                    self._pool._backoff = self._backoff
        if seconds is not None and requested > 0:
            _average(self._draft_s, requested, seconds)

    def _observe_positions(self, first: int, drafted: int, accepted: int) -> None:
        """Positions `first` to `drafted` - 1 of a draft whose first `accepted` tokens were accepted: each one reached
        (all before it accepted) is an observation of its acceptance."""
        for position in range(first, min(drafted, accepted + 1, self.max_draft_tokens)):
            outcome = 1.0 if position < accepted else 0.0
            self._seen[position] += 1
            weight = max(ACCEPTANCE_WEIGHT, 1 / (self._seen[position] + 1))
            self._acceptance[position] += weight * (outcome - self._acceptance[position])
        # A position never observed is expected to do as the one before it does: past the positions a session
        # drafts, a lookup whose first drafts are accepted tends to be accepted on (a fixed prior there would keep a
        # session from ever drafting far enough to find out), and a drafter whose first drafts fail fails on.
        for position in range(1, self.max_draft_tokens):
            if not self._seen[position]:
                self._acceptance[position] = self._acceptance[position - 1]

    def _observe_unverified(self, verified: int, accepted: int, offered: int) -> None:
        """A proposal in hand offered `offered` tokens, a step verified the first `verified` (all accepted), and the
        tokens the session generated after them show that its first `accepted` would have been accepted: the
        positions past `verified` are observed as if they had been drafted (acceptance only: no time, no decision)."""
        if self._pool is not None:
            self._pool._observe_unverified(verified, accepted, offered)
        self._observe_positions(verified, offered, accepted)

    def settle(self, tokens: Sequence[int], known: int, *, final: bool = False) -> None:
        """Judge the held tails of proposals in hand (`observe_step(unverified=...)`) by what the session generated:
        `tokens[:known]` are the verifier's own picks. A tail is observed once a token differs from it or it is
        covered; `final`: tokens not yet generated never will be (other tokens were appended), so the rest is
        dropped."""
        held, self._held = self._held, []
        for position, verified, tail in held:
            seen = tokens[position : min(known, position + len(tail))]
            matched = next((i for i, (a, b) in enumerate(zip(seen, tail, strict=False)) if a != b), len(seen))
            if matched < len(seen) or len(seen) == len(tail):
                self._observe_unverified(verified, verified + matched, verified + len(tail))
            elif not final:
                self._held.append((position, verified, tail))

    def observe_step(
        self,
        pending: int,
        burst: int,
        requested: int,
        drafted: int,
        accepted: int,
        *,
        draft_s: float | None,
        forward_s: float | None,
        unverified: Sequence[int] = (),
        position: int = 0,
    ) -> None:
        """What a decode step measured: its block held `pending` tokens before the draft; it ran `burst` plain steps
        in one call (then nothing was drafted), or asked for a draft of `requested` tokens, got `drafted` and had
        `accepted` of them accepted; `draft_s` and `forward_s` are the seconds of its proposal and forward. Times
        are kept only for a step whose block held one pending token: a longer one also verifies appended tokens,
        which says nothing of a decode step's cost. `unverified`: the rest of a proposal in hand that the step cut
        short (all of it, for a step that declined), for the history's `position` on; once every drafted token was
        accepted, it is held until the tokens the session generates judge it (`settle`), so a session that drafts
        short, or not at all, still learns how far a lookup's proposals would have been accepted."""
        timed = pending == 1
        if unverified and accepted == drafted:  # a burst verified no draft: its tokens are plain steps' picks
            self._held = [*self._held[1 - MAX_HELD :], (position, 0 if burst > 1 else drafted, list(unverified))]
        if burst > 1:
            if timed and forward_s is not None:
                self.observe_forward(1, forward_s, steps=burst)
            return
        if requested > 0 and (timed or drafted):  # an empty proposal after an append says nothing of drafting
            self.observe_draft(requested, accepted, draft_s if timed else None, drafted=drafted)
        if timed and forward_s is not None:
            self.observe_forward(drafted + 1, forward_s)

    def _paid(self, requested: int, drafted: int, accepted: int) -> bool:
        """Whether a step that asked for `requested` tokens and verified `drafted`, of which `accepted` were
        accepted, emitted tokens faster than plain steps would have, by the estimated times (True until
        they are measured)."""
        plain = self._forward_s.get(1)
        verify = _estimate(self._forward_s, drafted + 1)
        draft = _estimate(self._draft_s, requested)
        if plain is None or verify is None or draft is None:
            return True
        return (1 + accepted) * plain > draft + verify

    def observe_forward(self, block_tokens: int, seconds: float, steps: int = 1) -> None:
        """`steps` verifier forwards of `block_tokens` tokens each took `seconds` in all. A burst of plain steps
        (one decision) counts every one of its steps towards the next probe, as single plain steps would."""
        if self._pool is not None:
            self._pool.observe_forward(block_tokens, seconds, steps)
        if block_tokens > 0 and steps > 0:
            if block_tokens == 1 and 1 in self._borrowed:  # the pool's times, in proportion to this history's
                scale = seconds / steps / self._forward_s[1]
                self._forward_s.update({length: self._forward_s[length] * scale for length in self._borrowed})
                self._borrowed.clear()
            else:
                self._borrowed.discard(block_tokens)
                _average(self._forward_s, block_tokens, seconds / steps)
        if block_tokens == 1 and steps > 1 and self._plain_streak:
            self._plain_streak += steps - 1

    def _count(self, draft_tokens: int, decision: DraftDecision) -> tuple[int, DraftDecision]:
        if draft_tokens > 0:
            self._draft_streak, self._plain_streak = self._draft_streak + 1, 0
        else:
            self._draft_streak, self._plain_streak = 0, self._plain_streak + 1
        return draft_tokens, decision


def _average(table: dict[int, float], key: int, seconds: float) -> None:
    previous = table.get(key)
    table[key] = seconds if previous is None else previous + TIME_WEIGHT * (seconds - previous)


def _estimate(table: dict[int, float], length: int) -> float | None:
    """The measured seconds at `length`, else at the nearest longer measured length, else (past the longest
    measured) the line through the shortest and the longest measured lengths, never falling, carried on to
    `length`: a forward costs a fixed part and a part per token, and a block of a few more tokens costs a CPU
    little more. With one length measured, its seconds (the least a longer block costs). None when nothing was
    measured.

    A length never measured is so estimated at no more than it is likely to cost: a session that drafts it learns
    its real cost, while one that priced it too high would never draft it to find out."""
    if length in table:
        return table[length]
    longer = [key for key in table if key > length]
    if longer:
        return table[min(longer)]
    if not table:
        return None
    longest, shortest = max(table), min(table)
    if shortest == longest:
        return table[longest]
    slope = max(0.0, (table[longest] - table[shortest]) / (longest - shortest))
    return table[longest] + slope * (length - longest)
