"""The speculative decode step: draft a block, verify it in one forward, commit the accepted prefix; with a
generation's controls (grammar, penalties, stop sequences, log-probabilities) and, under the `cost` draft policy, a
per-session choice of the draft length (`DraftCostModel`). docs/architecture.md ("The decode step") describes one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kv_cache_proposer.controls import DecodeControls, pick_controlled
from kv_cache_proposer.errors import InvariantViolation
from kv_cache_proposer.proposers.base import DraftPolicy, NoDraftSession
from kv_cache_proposer.proposers.batch import DraftCommit, DraftRequest, commit_all, propose_all
from kv_cache_proposer.proposers.cost_model import DraftCostModel, DraftDecision
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.sequence import (
    DraftLength,
    GenerationBudget,
    SequenceState,
    StepRequest,
    StepResult,
    StopCause,
    first_stop,
)
from kv_cache_proposer.verifier import BatchBlock, Verifier, VerifyOutput

__all__ = [
    "Decoder",
    "DraftLength",
    "DraftPolicy",
    "GenerationBudget",
    "SequenceState",
    "StepRequest",
    "StepResult",
    "StopCause",
]


@dataclass(slots=True)
class _Plan:
    """A step between its drafting and its forward."""

    request: StepRequest
    block: list[int]  # the tokens the forward runs: a prefill chunk, or the pending tokens and the draft
    logits_rows: int
    feature_layers: Sequence[int]
    pending: int
    room: int
    draft: list[int]
    prefill: bool = False
    burst: int = 1  # plain greedy steps run back to back in one call (see `Decoder.burst_tokens`)
    wanted: int = 0  # draft tokens to ask the proposer for
    proposed: bool = False  # the proposer was asked already (the draft, cut to `wanted`, is attached)
    unverified: Sequence[int] = ()  # what the proposal offered past the draft
    draft_commit: DraftCommit | None = None  # what the draft session learns once the verifier committed
    decision: DraftDecision | None = None  # the `cost` policy's choice of `wanted`
    draft_s: float | None = None  # seconds of the proposal
    forward_s: float | None = None  # seconds of the forward (or of the whole burst)

    @property
    def seq(self) -> SequenceState:
        return self.request.seq


class Decoder:
    """Runs decode steps for sequences on one verifier."""

    def __init__(
        self,
        verifier: Verifier[Any],
        *,
        prefill_chunk_tokens: int | None = None,
        draft_policy: DraftPolicy = DraftPolicy.FULL,
        burst_tokens: int | None = None,
    ) -> None:
        """`prefill_chunk_tokens`: pending tokens one prefill forward takes; `burst_tokens`: how many plain greedy
        decode steps one call may run back to back (None: the verifier's defaults for its device)."""
        chunk = verifier.prefill_chunk_tokens if prefill_chunk_tokens is None else prefill_chunk_tokens
        burst = verifier.decode_burst_tokens if burst_tokens is None else burst_tokens
        if chunk < 1 or burst < 1:
            raise ValueError("prefill_chunk_tokens and burst_tokens must be >= 1")
        self.verifier = verifier
        self.prefill_chunk_tokens = chunk
        self.burst_tokens = burst
        self.draft_policy = DraftPolicy(draft_policy)
        self._cost_pools: dict[int, DraftCostModel] = {}  # draft limit -> what its sessions measured (`cost`)

    def step(
        self,
        seq: SequenceState,
        params: SamplingParams,
        budget: GenerationBudget,
        generated: int,
        controls: DecodeControls | None = None,
    ) -> StepResult:
        """Generate at least one token (or prefill one chunk of a long pending suffix); `generated` counts the
        tokens this generation produced so far (the last `generated` history tokens)."""
        return self._step_alone(self._plan(StepRequest(seq, params, budget, generated, controls)))

    def _step_alone(self, plan: _Plan) -> StepResult:
        """A planned step in a forward (or a burst) of its own; its draft session then learns the commit."""
        started = time.perf_counter()
        if plan.burst > 1:
            tokens, features = self.verifier.burst(plan.seq.cache, plan.block, plan.burst, plan.feature_layers)
            plan.forward_s = time.perf_counter() - started
            result = self._finish_burst(plan, tokens, features)
        else:
            out = self.verifier.verify(plan.seq.cache, plan.block, plan.logits_rows, feature_layers=plan.feature_layers)
            plan.forward_s = time.perf_counter() - started
            result = self._finish(plan, out)
        if plan.draft_commit is not None:
            plan.draft_commit.deliver()
        return result

    def step_batch(self, requests: Sequence[StepRequest]) -> list[StepResult | Exception]:
        """One step of each request (of distinct sessions), their verifier blocks run in one batched forward.

        Each result is what `step` alone would return for that request, or the exception it would raise: a
        failing session never fails the others. Should the batched forward itself raise, each block is run alone,
        so the error lands on the session that caused it. Draft sessions that share a batch drafter propose, and
        learn their commits, together (`proposers.batch`).
        """
        results: list[StepResult | Exception | None] = [None] * len(requests)
        planned: list[tuple[int, _Plan]] = []
        for index, request in enumerate(requests):
            try:
                planned.append((index, self._plan(request, propose=False, alone=len(requests) == 1)))
            except Exception as exc:  # handed to that session's caller
                results[index] = exc
        if len(planned) == 1 and planned[0][1].burst > 1:
            index, plan = planned[0]
            try:
                results[index] = self._step_alone(plan)
            except Exception as exc:  # handed to that session's caller
                results[index] = exc
            planned = []
        drafting = [plan for _, plan in planned if plan.wanted > 0 and not plan.proposed]
        started = time.perf_counter()
        proposed = propose_all([DraftRequest(p.seq.draft_session, p.seq.tokens, p.wanted) for p in drafting])
        for plan in drafting:  # drafters that share a batch drafter propose in one forward, as one wait
            plan.draft_s = time.perf_counter() - started
        drafts = {id(plan): draft for plan, draft in zip(drafting, proposed, strict=True)}
        plans: list[tuple[int, _Plan]] = []
        for index, plan in planned:
            draft = drafts.get(id(plan))
            if isinstance(draft, Exception):
                results[index] = draft
                continue
            if draft is not None:
                self._attach_draft(plan, draft)
            plans.append((index, plan))
        groups: dict[tuple[int, ...], list[tuple[int, _Plan]]] = {}
        for item in plans:
            groups.setdefault(tuple(item[1].feature_layers), []).append(item)
        for layers, group in groups.items():
            outs: list[VerifyOutput[Any] | Exception]
            started = time.perf_counter()
            try:
                blocks = [BatchBlock(plan.seq.cache, plan.block, plan.logits_rows) for _, plan in group]
                outs = list(self.verifier.verify_batch(blocks, feature_layers=layers))
            except Exception:  # rerun alone below, each error goes to its own session
                outs = [self._verify_alone(plan) for _, plan in group]
            elapsed = time.perf_counter() - started
            for (index, plan), out in zip(group, outs, strict=True):
                plan.forward_s = elapsed  # every session in the forward waited for all of it
                if isinstance(out, Exception):
                    results[index] = out
                    continue
                try:
                    results[index] = self._finish(plan, out)
                except Exception as exc:  # handed to that session's caller
                    results[index] = exc
        committed = [
            (index, plan.draft_commit)
            for index, plan in plans
            if plan.draft_commit is not None and isinstance(results[index], StepResult)
        ]
        for (index, _), error in zip(committed, commit_all([commit for _, commit in committed]), strict=True):
            if error is not None:
                results[index] = error
        return [result if result is not None else RuntimeError("step not run") for result in results]

    def _verify_alone(self, plan: _Plan) -> VerifyOutput[Any] | Exception:
        try:
            cache, layers = plan.seq.cache, plan.feature_layers
            return self.verifier.verify(cache, plan.block, plan.logits_rows, feature_layers=layers)
        except Exception as exc:  # handed to that session's caller
            return exc

    def _plan(self, request: StepRequest, *, propose: bool = True, alone: bool = True) -> _Plan:
        """Everything a step decides before its forward: a prefill chunk, or the pending tokens and a draft
        (`propose=False`: no draft yet; `wanted` says how long one may be, `_attach_draft` adds it), or, for a
        plain greedy step that runs `alone`, how many steps to run back to back. Under `cost`, a proposal that
        costs next to nothing (`DraftCostModel.peeks`) is made first, whatever `propose`, and decided with."""
        seq, budget, generated = request.seq, request.budget, request.generated
        self._check_position(seq)
        pending = seq.pending_count
        if pending < 1:
            raise ValueError("the session has no pending token to continue from")
        layers, start = seq.draft_session.feature_layers, seq.committed
        room = budget.max_new_tokens - generated
        if budget.max_history_tokens is not None:
            room = min(room, budget.max_history_tokens - len(seq.tokens))
        seq.cache.expect(pending + max(room, 0))  # no room for more: the session's peak is what it can fill
        if pending > self.prefill_chunk_tokens:
            chunk = self.prefill_chunk_tokens
            return _Plan(request, seq.tokens[start : start + chunk], 1, layers, pending, 0, [], prefill=True)

        if room < 1:
            raise ValueError("no room left for another token")
        limit = seq.draft_length.current if self.draft_policy is DraftPolicy.ADAPTIVE else seq.draft_length.limit
        wanted = max(0, min(limit, room - 1))
        decision, proposal = None, None  # proposal: the draft and the seconds it took, once asked for
        if self.draft_policy is DraftPolicy.COST and wanted > 0:
            costs = seq.draft_costs
            costs.join(self._cost_pool(costs.max_draft_tokens))
            costs.settle(seq.tokens, len(seq.tokens) - pending + 1, final=pending > 1)
            if costs.peeks(wanted):  # a cheap proposal: decide with it in hand
                proposal = self._timed_proposal(seq, wanted)
            offered = None if proposal is None else len(proposal[0])
            wanted, decision = costs.decide(wanted, decoding=pending == 1, offered=offered)
        burst = min(self.burst_tokens, room) if alone and self._bursts(request, wanted) else 1
        plan = _Plan(
            request, seq.tokens[start:], 1, layers, pending, room, [], burst=burst, wanted=wanted, decision=decision
        )
        if proposal is None and propose and wanted > 0 and burst == 1:
            proposal = self._timed_proposal(seq, wanted)
        if proposal is not None:
            plan.proposed, plan.draft_s = True, proposal[1]
            if wanted > 0:
                self._attach_draft(plan, proposal[0])
            else:  # declined with a lookup in hand: the tokens generated next judge all of it
                plan.unverified = proposal[0]
        return plan

    @staticmethod
    def _timed_proposal(seq: SequenceState, wanted: int) -> tuple[list[int], float]:
        """The draft session's proposal of up to `wanted` tokens, and the seconds it took."""
        started = time.perf_counter()
        draft = seq.draft_session.propose(seq.tokens, wanted)
        return draft, time.perf_counter() - started

    def _cost_pool(self, limit: int) -> DraftCostModel:
        """What the sessions of draft limit `limit` measured (`cost`), built the first time one asks."""
        pool = self._cost_pools.get(limit)
        if pool is None:
            pool = self._cost_pools[limit] = DraftCostModel(limit)
        return pool

    @staticmethod
    def _attach_draft(plan: _Plan, proposed: list[int]) -> None:
        """Append the proposer's draft (cut to what the step may verify) to the plan's block."""
        draft = proposed[: plan.wanted]
        controls = plan.request.controls
        grammar = controls.grammar if controls is not None else None
        if grammar is not None:
            # Tokens the grammar forbids are never verified (the proposer's acceptance is judged on the rest).
            draft = draft[: grammar.valid_prefix(draft)]
        plan.draft, plan.unverified = draft, proposed[len(draft) :]
        plan.block = plan.block + draft
        plan.logits_rows = len(draft) + 1

    @staticmethod
    def _bursts(request: StepRequest, wanted: int) -> bool:
        """Whether a step may run plain greedy steps back to back: no proposer, or a step that drafts nothing (a
        burst returns the features a drafter needs), greedy, nothing that reshapes or constrains the logits, a
        cache that takes no layer outputs of its own (a restoring cache whose plan projects from the drafter's
        context takes them from every forward), and not the generation's first token (whose latency a burst would
        add to)."""
        seq, controls = request.seq, request.controls
        return (
            (isinstance(seq.draft_session, NoDraftSession) or wanted == 0)
            and request.params.greedy
            and (controls is None or (not controls.transforms_logits and controls.grammar is None))
            and not seq.cache.restoration_feature_layers
            and request.generated > 0
        )

    def _finish_burst(self, plan: _Plan, tokens: list[int], features: Any | None) -> StepResult:
        """After `plan.burst` greedy steps in one verifier call, the stop rules cut the tokens as a speculative step
        whose drafts were all accepted would be cut (the K/V after a cut are never committed)."""
        plan.draft, plan.logits_rows = tokens[:-1], len(tokens)
        return self._finish(plan, None, tokens, features)

    def _finish(
        self,
        plan: _Plan,
        out: VerifyOutput[Any] | None,
        picked: list[int] | None = None,
        picked_features: Any | None = None,
    ) -> StepResult:
        """Everything a step does after its forward: sample, accept, stop, commit. `picked`: the tokens a burst
        already chose (then there is no `out`), with `picked_features` the features of its staged positions."""
        features = picked_features if out is None else out.features
        seq, params, budget = plan.seq, plan.request.params, plan.request.budget
        generated, controls = plan.request.generated, plan.request.controls
        if plan.prefill:
            chunk = len(plan.block)
            self._commit(plan, chunk, features)
            return StepResult(prefilled=chunk, forwards=1)
        pending, room, draft = plan.pending, plan.room, plan.draft
        start = seq.committed
        grammar = controls.grammar if controls is not None else None
        # Row i holds the verifier's distribution for global position start + pending + i.
        positions = [start + pending + i for i in range(len(draft) + 1)]
        logprobs = None
        dead_end_row = None  # rows from a grammar dead end on cannot emit a token
        if picked is not None:
            sampled = picked
        elif out is None:
            raise ValueError("a step without a forward's output needs its picked tokens")
        elif controls is not None and controls.transforms_logits:
            picks = pick_controlled(
                self.verifier.host_logits(out.logits), params, positions, controls, seq.tokens, draft
            )
            sampled, logprobs, dead_end_row = picks.tokens, picks.logprobs, picks.dead_end_row
        else:
            sampled = self.verifier.pick_tokens(out.logits, params, positions)
        accepted = _accepted_prefix(draft, sampled)
        burst = plan.burst > 1
        if not burst:
            seq.draft_length.update(len(draft), accepted)
        if self.draft_policy is DraftPolicy.COST:
            # Untimed: a generation's first forward also reads back what a pause left (a compressed fork's codes).
            seq.draft_costs.observe_step(
                pending, plan.burst, plan.wanted, len(draft), accepted, draft_s=plan.draft_s,
                forward_s=plan.forward_s if generated else None,
                unverified=plan.unverified, position=len(seq.tokens) + (0 if burst else len(draft)),
            )  # fmt: skip
        emitted = sampled[: accepted + 1]
        stop = None
        if dead_end_row is not None and dead_end_row < len(emitted):
            emitted, stop = emitted[:dead_end_row], StopCause.GRAMMAR_DEAD_END
        stop_sequences = controls.stop_sequences if controls is not None else ()
        cut, stop_found, stop_index = first_stop(emitted, seq.tokens, generated, budget, stop_sequences)
        stop = stop_found or stop
        if cut >= room:
            if cut > room:
                cut, stop, stop_index = room, None, None
            if stop is None:
                stop = self._limit_cause(budget, generated + cut)
        emitted = emitted[:cut]
        if grammar is not None:
            grammar.advance(emitted)
        # The last emitted token stays pending; everything before it in the block is committed.
        self._commit(plan, pending + len(emitted) - 1, features, new_tokens=emitted)
        return StepResult(
            tokens=emitted,
            prefilled=pending - 1,
            drafted=0 if burst else len(draft),
            accepted=0 if burst else max(0, len(emitted) - 1),
            forwards=plan.burst,
            stop=stop,
            logprobs=logprobs[: len(emitted)] if logprobs is not None else None,
            stop_sequence_index=stop_index,
            decision=plan.decision,
        )

    def _commit(self, plan: _Plan, count: int, features: Any | None, new_tokens: Sequence[int] = ()) -> None:
        """Commit `count` block positions in the verifier cache; the draft session learns it after (`draft_commit`,
        which the caller hands on, so that sessions stepping together may learn theirs together)."""
        seq = plan.seq
        expected = seq.committed + count
        self.verifier.commit(seq.cache, count)
        seq.tokens.extend(new_tokens)
        self._check_position(seq, expected)
        if expected > len(seq.tokens):
            raise InvariantViolation("inv1", f"{expected} committed positions for a history of {len(seq.tokens)}")
        seq.committed = expected
        plan.draft_commit = DraftCommit(
            seq.draft_session, seq.tokens, expected, None if features is None else features[:count]
        )

    @staticmethod
    def _check_position(seq: SequenceState, expected: int | None = None) -> None:
        """INV-2: the cache's next position never falls behind the bookkeeping; INV-1: it matches it."""
        expected = seq.committed if expected is None else expected
        actual = int(seq.cache.next_position)
        if actual < seq.committed:
            raise InvariantViolation("inv2", f"next position went from {seq.committed} back to {actual}")
        if actual != expected:
            raise InvariantViolation("inv1", f"the cache holds {actual} positions, the history records {expected}")

    @staticmethod
    def _limit_cause(budget: GenerationBudget, generated: int) -> StopCause:
        if generated >= budget.max_new_tokens:
            return StopCause.MAX_TOKENS
        return StopCause.HISTORY_LIMIT


def _accepted_prefix(draft: Sequence[int], sampled: Sequence[int]) -> int:
    accepted = 0
    for proposed, verified in zip(draft, sampled, strict=False):
        if proposed != verified:
            break
        accepted += 1
    return accepted
