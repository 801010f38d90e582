"""One generation's loop: its steps through the step scheduler, its tokens journaled and streamed as they come.

The loop queues a step's successor as soon as the step returns, before its tokens are streamed: the model worker
computes the next step while the event loop journals, counts and streams this one's tokens, so the per-token work
of the transport never sits between two forwards. While the generation steps alone, the worker starts that
successor itself as the step returns (the step scheduler's chaining), and the loop takes it over instead of queueing
one. A step that ends the generation (a stop, the token budget) has no successor. When the generation ends
otherwise (the client goes away, a cancellation, an error), a successor already in a forward completes — its
tokens are in the session's history, as any completed step's are — and is streamed (on a cancellation) or
journaled (otherwise) before the generation lets go of the session, so the journal, the stream and the history
never disagree; so is a step the worker chained after it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inference_engine.domain import (
    DoneEvent,
    GenerateEvent,
    GenerationStats,
    StopReason,
    TokenEvent,
    TruncatedEvent,
)
from inference_engine.errors import ResourceExhausted
from inference_engine.journal import JournalAppended, JournalError
from inference_engine.sessions import Session
from inference_engine.step_scheduler import StepScheduler, StepTicket
from kv_cache_proposer.controls import DecodeControls
from kv_cache_proposer.decoding import GenerationBudget, StepRequest, StepResult, StopCause
from kv_cache_proposer.errors import InvariantViolation
from kv_cache_proposer.sampling import SamplingParams

if TYPE_CHECKING:
    from inference_engine.runtime import Runtime

log = logging.getLogger(__name__)

_GAUGE_INTERVAL_S = 0.25  # how stale the KV gauges may get while a generation runs (they are exact once it ends)

STOP_REASONS = {
    StopCause.EOS: StopReason.EOS,
    StopCause.MAX_TOKENS: StopReason.MAX_TOKENS,
    StopCause.HISTORY_LIMIT: StopReason.TRUNCATED,
    StopCause.STOP_SEQUENCE: StopReason.STOP_SEQUENCE,
    StopCause.GRAMMAR_DEAD_END: StopReason.GRAMMAR_DEAD_END,
}


@dataclass(slots=True)
class Tally:
    """Running totals of one generation."""

    started: float
    prefill_tokens: int
    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    stop_sequence_index: int | None = None

    def add(self, step: StepResult) -> None:
        self.drafted += step.drafted
        self.accepted += step.accepted
        self.forwards += step.forwards
        if step.stop_sequence_index is not None:
            self.stop_sequence_index = step.stop_sequence_index

    def stats(self, reason: StopReason, now: float) -> GenerationStats:
        first = self.first_token_at
        return GenerationStats(
            stop_reason=reason,
            generated_token_count=self.generated,
            prefill_token_count=self.prefill_tokens,
            prefill_duration_s=(first if first is not None else now) - self.started,
            total_duration_s=now - self.started,
            time_to_first_token_s=(first - self.started) if first is not None else 0.0,
            draft_token_count=self.drafted,
            accepted_draft_token_count=self.accepted,
            verifier_forward_count=self.forwards,
            stop_sequence_index=self.stop_sequence_index,
        )


class _Successor:
    """A generation's next step: queued on the step scheduler before the current step's tokens are streamed, or
    chained by the worker after the current step."""

    def __init__(self, scheduler: StepScheduler, ticket: StepTicket, cancel: asyncio.Event) -> None:
        self._scheduler = scheduler
        self._ticket = ticket
        self._cancel = cancel

    @classmethod
    def submit(cls, scheduler: StepScheduler, request: StepRequest, cancel: asyncio.Event) -> _Successor:
        """Queue `request` as the generation's next step."""
        return cls(scheduler, scheduler.submit(request, cancel), cancel)

    def chained(self) -> _Successor | None:
        """The step the worker chained after this one (known once this one's result is in), taken over by the
        generation."""
        ticket = self._ticket.chained
        return None if ticket is None else _Successor(self._scheduler, ticket, self._cancel)

    async def result(self) -> StepResult:
        """The step's result; raises what the step raised. A cancelled task marks the generation cancelled at
        once; a step already in a forward completes first (see `StepScheduler.step`)."""
        return await self._scheduler.result(self._ticket, self._cancel)

    async def withdraw(self) -> StepResult | None:
        """Drop the step if it has not reached a forward (None); else wait for it and return its result, so the
        caller accounts for the tokens it added to the history. Raises what the step raised. The worker chains
        no step after it (one it already chained is still found by `chained`)."""
        self._ticket.chain = False
        if self._scheduler.withdraw(self._ticket):
            return None
        return await self._scheduler.settled(self._ticket)


async def run_generation(
    runtime: Runtime,
    session: Session,
    sampling: SamplingParams,
    budget: GenerationBudget,
    controls: DecodeControls,
) -> AsyncGenerator[GenerateEvent, None]:
    """The steps of one generation on a session that holds its generation turn, as events."""
    seq = session.seq
    cancel = session.cancel
    assert cancel is not None
    metrics, scheduler = runtime.metrics, runtime.step_scheduler
    clock = time.perf_counter
    tally = Tally(started=clock(), prefill_tokens=seq.pending_count)
    metrics.session_history_tokens.observe(len(seq.tokens))
    outcome = "cancelled"  # unless the loop below ends otherwise, the client went away mid-stream
    reason: StopReason | None = None
    successor: _Successor | None = None
    scheduler.begin_generation()
    try:
        while reason is None or successor is not None:
            try:
                if cancel.is_set():
                    # A successor already in a forward (and one chained after it) still delivers its tokens:
                    # they are history now.
                    reason = StopReason.CANCELLED
                    if successor is None:
                        break
                    found = await successor.withdraw()
                    if found is None:
                        successor = None
                        break
                    step = found
                else:
                    if successor is None:
                        request = StepRequest(seq, sampling, budget, tally.generated, controls)
                        successor = _Successor.submit(scheduler, request, cancel)
                    step = await successor.result()
                # A step the worker chained after this one is the generation's from now on (settled if it ends).
                successor = successor.chained()
            except InvariantViolation as exc:
                successor = None
                outcome = "failed"
                raise runtime.fail_session(session, exc) from exc
            tally.add(step)
            record_step(runtime, step)
            if step.tokens and tally.first_token_at is None:
                tally.first_token_at = clock()
                record_prefill(runtime, tally)
                if seq.cache.lost_count:
                    yield TruncatedEvent(int(seq.cache.lost_count))
            # Every token of the step is in the history now, even if the consumer stops reading midway; it is
            # journaled before any of it reaches the client.
            try:
                await journal_tokens(runtime, session, step)
            except JournalError as exc:
                outcome = "failed"
                raise runtime.fail_unjournaled(session, exc) from exc
            if successor is None and step.stop is None and reason is None:
                request = StepRequest(seq, sampling, budget, tally.generated + len(step.tokens), controls)
                successor = _Successor.submit(scheduler, request, cancel)
            metrics.generate_tokens.inc(len(step.tokens))
            for index, token in enumerate(step.tokens):
                now = clock()
                if tally.last_token_at is not None:
                    metrics.generate_inter_token_latency_seconds.observe(now - tally.last_token_at)
                tally.last_token_at = now
                tally.generated += 1
                yield TokenEvent(token, step.logprobs[index] if step.logprobs is not None else None)
            runtime.store.touch(session)
            within_budget = runtime.store.enforce_budget(protect=session)
            runtime.store.refresh_gauges_every(_GAUGE_INTERVAL_S)
            if not within_budget:
                outcome = "resource_exhausted"
                raise ResourceExhausted(
                    f"running sessions hold {runtime.store.kv_live_bytes()} KV bytes, over --kv-budget-bytes "
                    f"{runtime.config.kv_budget_bytes}, and no idle session is left to evict"
                )
            if step.stop is not None and reason is None:
                reason = STOP_REASONS[step.stop]
        if tally.first_token_at is None:
            record_prefill(runtime, tally)
        stats = tally.stats(reason, clock())
        if stats.generated_token_count:
            metrics.generate_verifier_forwards_per_token.observe(
                stats.verifier_forward_count / stats.generated_token_count
            )
        outcome = reason.value
        log.info(
            "generation done",
            extra={
                "session_id": session.session_id,
                "stop_reason": reason.value,
                "generated": stats.generated_token_count,
                "prefill_tokens": stats.prefill_token_count,
                "duration_s": round(stats.total_duration_s, 4),
            },
        )
        yield DoneEvent(stats)
    finally:
        if successor is not None:
            await settle_successor(runtime, session, successor)
        scheduler.end_generation()
        metrics.generate_requests.labels(outcome=outcome).inc()


async def settle_successor(runtime: Runtime, session: Session, successor: _Successor | None) -> None:
    """The successor of a generation that ended early (its client went away, an error): dropped if it has not
    reached a forward; if it has, it completes and its tokens, now in the history, are journaled (and so are those
    of a step the worker chained after it)."""
    while successor is not None:
        try:
            step = await successor.withdraw()
        except InvariantViolation as exc:
            runtime.fail_session(session, exc)
            return
        except Exception:  # the generation already ends with its own error; this step's is the same session's
            log.debug("the successor step of an ended generation failed", exc_info=True)
            return
        if step is None:
            return
        record_step(runtime, step)
        try:
            await journal_tokens(runtime, session, step)
        except JournalError as exc:
            runtime.fail_unjournaled(session, exc)
            return
        successor = successor.chained()


async def journal_tokens(runtime: Runtime, session: Session, step: StepResult) -> None:
    if step.tokens and runtime.journal is not None:
        await runtime.journal.write(JournalAppended(session.session_id, tuple(step.tokens), time.time()))


def record_step(runtime: Runtime, step: StepResult) -> None:
    metrics = runtime.metrics
    metrics.verifier_forwards.inc(step.forwards)
    if step.decision is not None:
        metrics.speculative_decisions.labels(decision=step.decision.value).inc()
    if step.drafted:
        metrics.speculative_drafts.inc()
        metrics.speculative_draft_tokens.inc(step.drafted)
        metrics.speculative_accepted_tokens.inc(step.accepted)
        metrics.speculative_acceptance_length.observe(step.accepted)


def record_prefill(runtime: Runtime, tally: Tally) -> None:
    metrics = runtime.metrics
    end = tally.first_token_at if tally.first_token_at is not None else time.perf_counter()
    metrics.generate_prefill_tokens.observe(tally.prefill_tokens)
    metrics.generate_prefill_duration_seconds.observe(end - tally.started)
    if tally.first_token_at is not None:
        metrics.generate_time_to_first_token_seconds.observe(end - tally.started)
