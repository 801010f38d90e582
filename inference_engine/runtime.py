"""The session service: creates sessions, appends tokens, runs generations on the model worker, frees memory.

Transport-neutral: the gRPC servicer (and the HTTP shim) call these coroutines and convert what they return.
Everything here runs on the event loop; tensor work goes through the `ModelWorker`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass
from typing import Any

from inference_engine.config import ServerConfig
from inference_engine.domain import (
    CreateParams,
    DoneEvent,
    GenerateEvent,
    GenerateParams,
    GenerationStats,
    SessionInfo,
    StopReason,
    TokenEvent,
    TruncatedEvent,
)
from inference_engine.errors import InvalidArgument, ResourceExhausted, SessionFailed, ShuttingDown
from inference_engine.metrics import Metrics
from inference_engine.persistence import SessionRecord, SnapshotError
from inference_engine.scheduling import Scheduler
from inference_engine.sessions import Session, SessionStore
from inference_engine.validation import RequestChecks
from inference_engine.worker import ModelWorker
from kv_cache_proposer.compression import KVCompressor, compressor_layer_store
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState, StepResult, StopCause
from kv_cache_proposer.errors import InvariantViolation
from kv_cache_proposer.proposers.base import NoProposer, Proposer
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import KVStrategy, make_strategy, strategy_options
from kv_cache_proposer.verifier import Verifier

log = logging.getLogger(__name__)

_STOP_REASONS = {
    StopCause.EOS: StopReason.EOS,
    StopCause.MAX_TOKENS: StopReason.MAX_TOKENS,
    StopCause.HISTORY_LIMIT: StopReason.TRUNCATED,
}


@dataclass(slots=True)
class _Tally:
    """Running totals of one generation."""

    started: float
    prefill_tokens: int
    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None

    def add(self, step: StepResult) -> None:
        self.drafted += step.drafted
        self.accepted += step.accepted
        self.forwards += step.forwards

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
        )


class Runtime:
    """Sessions bound to one loaded verifier."""

    def __init__(
        self,
        verifier: Verifier,
        config: ServerConfig,
        metrics: Metrics,
        *,
        proposer: Proposer | None = None,
    ) -> None:
        self.verifier = verifier
        self.config = config
        self.metrics = metrics
        self.proposer = proposer or NoProposer()
        self.checks = RequestChecks(config, verifier.vocab_size)
        self.worker = ModelWorker()
        self.decoder = Decoder(verifier, prefill_chunk_tokens=config.prefill_chunk_tokens)
        self.store = SessionStore(
            max_sessions=config.max_sessions,
            idle_ttl_s=config.session_idle_ttl_s,
            kv_budget_bytes=config.kv_budget_bytes,
            metrics=metrics,
        )
        self.scheduler = Scheduler(max_concurrent=config.max_concurrent, queue_deadline_s=config.queue_deadline_s)
        self._accepting = True

    # -- requests ----------------------------------------------------------------------------------------------
    async def create_session(self, params: CreateParams) -> tuple[str, int]:
        """Allocate a session; returns (session id, history length)."""
        self._check_accepting()
        strategy = self.checks.strategy(params)
        compressor = self.checks.compressor(params)
        eos = self.checks.tokens(params.eos_token_ids, "eos_token_ids")
        initial = self.checks.append(0, params.initial_token_ids, "initial_token_ids")
        session = self._open_session(
            self.store.new_id(), params.label, eos, strategy, initial, self.store.now(), compressor
        )
        log.info(
            "session created",
            extra={
                "session_id": session.session_id,
                "label": params.label,
                "strategy": strategy.name,
                "kv_compressor": compressor.name,
            },
        )
        return session.session_id, len(session.seq.tokens)

    async def append(self, session_id: str, token_ids: Iterable[int]) -> int:
        """Append tokens to a session's history (pending until the next generation); returns the history length."""
        self._check_accepting()
        session = self.store.get(session_id)
        async with self.scheduler.session_turn(session):
            tokens = self.checks.append(len(session.seq.tokens), token_ids, "token_ids")
            session.seq.tokens.extend(tokens)
            return len(session.seq.tokens)

    async def generate(
        self, session_id: str, params: GenerateParams, cancel: asyncio.Event | None = None
    ) -> AsyncGenerator[GenerateEvent, None]:
        """Run one generation, yielding token events and a final `DoneEvent`.

        Setting `cancel` stops the generation after its current step with stop reason CANCELLED.
        """
        self._check_accepting()
        sampling, budget_stops = self.checks.generate(params)
        session = self.store.get(session_id)
        async with self.scheduler.generation_turn(session):
            seq = session.seq
            if not seq.tokens:
                raise InvalidArgument("the session history is empty: append tokens before generating")
            if len(seq.tokens) >= self.config.max_history_tokens:
                raise ResourceExhausted(f"the session holds {len(seq.tokens)} tokens, the --max-history-tokens limit")
            budget = GenerationBudget(
                max_new_tokens=params.max_tokens,
                stop_token_ids=session.eos_token_ids | budget_stops,
                max_history_tokens=self.config.max_history_tokens,
            )
            session.cancel = cancel or asyncio.Event()
            session.generating = True
            try:
                async for event in self._run_generation(session, sampling, budget):
                    yield event
            finally:
                session.generating = False
                session.cancel = None
                # Between generations the session holds only its resident storage (packed bytes if compressed);
                # dropping the working copy is only reference release, so it needs no turn on the model worker.
                seq.cache.park()
                self.store.touch(session)
                self.store.refresh_gauges()

    async def close_session(self, session_id: str) -> int:
        """Close a session: a running generation is cancelled, then its memory is freed. Returns the final
        history length."""
        session = self.store.get(session_id, touch=False)
        self.store.detach(session, "closed", "closed")
        if session.cancel is not None:
            session.cancel.set()
        async with session.lock:
            session.release()
        self.store.refresh_gauges()
        log.info("session closed", extra={"session_id": session_id, "history_length": len(session.seq.tokens)})
        return len(session.seq.tokens)

    def session_info(self, session_id: str, history_tail_tokens: int = 0) -> SessionInfo:
        """Describe a session without counting as an access; optionally include the last history tokens."""
        if history_tail_tokens > self.config.max_append_tokens:
            raise InvalidArgument(
                f"history_tail_tokens {history_tail_tokens} is above the limit {self.config.max_append_tokens}"
            )
        session = self.store.get(session_id, touch=False)
        tokens = session.seq.tokens
        cache = session.seq.cache
        strategy = cache.strategy
        return SessionInfo(
            history_length=len(tokens),
            kv_live_bytes=session.kv_bytes,
            idle_seconds=max(0.0, self.store.now() - session.last_access),
            kv_strategy=strategy.name,
            resident_token_count=int(cache.resident_count),
            kv_compressed_bytes=int(cache.compressed_bytes),
            pending_token_count=session.seq.pending_count,
            evicted_token_count=int(cache.evicted_count),
            client_label=session.label,
            generating=session.generating,
            sink_tokens=strategy_options(strategy).get("sink", 0),
            window_tokens=strategy_options(strategy).get("window", 0),
            invariant_violations=dict(session.invariant_violations),
            history_tail=tuple(tokens[len(tokens) - history_tail_tokens :]) if history_tail_tokens else (),
            kv_compressor=session.compressor.name,
            kv_q_range=session.compressor.q_range if session.compressor.lattice else 0,
            kv_dense_equivalent_bytes=int(cache.dense_equivalent_bytes),
            kv_escaped_blocks=int(cache.escaped_vectors),
        )

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def model_identity(self) -> dict[str, Any]:
        """What a session snapshot must match to be restored into this runtime."""
        return {
            "model": str(self.config.model_dir.resolve()),
            "backend": self.config.backend,
            "vocab_size": self.verifier.vocab_size,
        }

    def restore_sessions(self, records: list[SessionRecord]) -> None:
        """Bring snapshot sessions back under their ids, with their whole history pending."""
        for record in records:
            try:
                strategy = make_strategy(record.kv_strategy, sink=record.sink, window=record.window)
                eos = self.checks.tokens(record.eos_token_ids, "eos_token_ids")
                tokens = self.checks.tokens(record.tokens, "tokens")
            except (ValueError, InvalidArgument) as exc:
                raise SnapshotError(
                    f"session {record.session_id!r} of the snapshot cannot be restored: {exc}"
                ) from None
            last_access = self.store.now() - record.idle_seconds
            compressor = self.config.compressor()
            self._open_session(record.session_id, record.label, eos, strategy, tokens, last_access, compressor)

    def evict_idle(self) -> int:
        return self.store.evict_idle()

    @property
    def active_generations(self) -> int:
        return sum(1 for s in self.store.sessions() if s.generating)

    def stop_accepting(self) -> None:
        self._accepting = False

    def cancel_all(self) -> None:
        """Ask every running generation to stop after its current step."""
        for session in self.store.sessions():
            if session.cancel is not None:
                session.cancel.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no generation runs, up to `timeout_s`; returns whether it is idle."""
        deadline = time.monotonic() + timeout_s
        while self.active_generations and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.active_generations == 0

    def shutdown(self) -> None:
        self.worker.shutdown()

    # -- internals ---------------------------------------------------------------------------------------------
    def _open_session(
        self,
        session_id: str,
        label: str,
        eos: Iterable[int],
        strategy: KVStrategy,
        tokens: list[int],
        last_access: float,
        compressor: KVCompressor,
    ) -> Session:
        layer_store = compressor_layer_store(self.config.backend, compressor)
        seq = SequenceState(
            cache=self.verifier.new_cache(strategy, layer_store=layer_store),
            tokens=list(tokens),
            draft=self.proposer.open(strategy),
        )
        session = Session(
            session_id=session_id,
            label=label,
            eos_token_ids=frozenset(eos),
            seq=seq,
            last_access=last_access,
            compressor=compressor,
        )
        self.store.add(session)
        return session

    async def _run_generation(
        self, session: Session, sampling: SamplingParams, budget: GenerationBudget
    ) -> AsyncGenerator[GenerateEvent, None]:
        seq = session.seq
        cancel = session.cancel
        assert cancel is not None
        clock = time.perf_counter
        tally = _Tally(started=clock(), prefill_tokens=seq.pending_count)
        self.metrics.session_history_tokens.observe(len(seq.tokens))
        outcome = "cancelled"  # unless the loop below ends otherwise, the client went away mid-stream
        reason: StopReason | None = None
        try:
            while reason is None:
                if cancel.is_set():
                    reason = StopReason.CANCELLED
                    break
                try:
                    step = await self.worker.run(self.decoder.step, seq, sampling, budget, tally.generated)
                except InvariantViolation as exc:
                    outcome = "failed"
                    raise self._fail(session, exc) from exc
                tally.add(step)
                self._record_step(step)
                if step.tokens and tally.first_token_at is None:
                    tally.first_token_at = clock()
                    self._record_prefill(tally)
                    if seq.cache.evicted_count:
                        yield TruncatedEvent(int(seq.cache.evicted_count))
                # Every token of the step is in the history now, even if the consumer stops reading midway.
                self.metrics.generate_tokens.inc(len(step.tokens))
                for token in step.tokens:
                    now = clock()
                    if tally.last_token_at is not None:
                        self.metrics.generate_inter_token_latency_seconds.observe(now - tally.last_token_at)
                    tally.last_token_at = now
                    tally.generated += 1
                    yield TokenEvent(token)
                self.store.touch(session)
                within_budget = self.store.enforce_budget(protect=session)
                self.store.refresh_gauges()
                if not within_budget:
                    outcome = "resource_exhausted"
                    raise ResourceExhausted(
                        f"running sessions hold {self.store.kv_live_bytes()} KV bytes, over --kv-budget-bytes "
                        f"{self.config.kv_budget_bytes}, and no idle session is left to evict"
                    )
                if step.stop is not None:
                    reason = _STOP_REASONS[step.stop]
            if tally.first_token_at is None:
                self._record_prefill(tally)
            stats = tally.stats(reason, clock())
            if stats.generated_token_count:
                self.metrics.generate_verifier_forwards_per_token.observe(
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
            self.metrics.generate_requests.labels(outcome=outcome).inc()

    def _record_step(self, step: StepResult) -> None:
        self.metrics.verifier_forwards.inc(step.forwards)
        if step.drafted:
            self.metrics.speculative_drafts.inc()
            self.metrics.speculative_draft_tokens.inc(step.drafted)
            self.metrics.speculative_accepted_tokens.inc(step.accepted)
            self.metrics.speculative_acceptance_length.observe(step.accepted)

    def _record_prefill(self, tally: _Tally) -> None:
        end = tally.first_token_at if tally.first_token_at is not None else time.perf_counter()
        self.metrics.generate_prefill_tokens.observe(tally.prefill_tokens)
        self.metrics.generate_prefill_duration_seconds.observe(end - tally.started)
        if tally.first_token_at is not None:
            self.metrics.generate_time_to_first_token_seconds.observe(end - tally.started)

    def _fail(self, session: Session, exc: InvariantViolation) -> SessionFailed:
        """Fail a session whose cache broke an invariant: count it, free it, and return the error to raise."""
        session.invariant_violations[exc.kind] += 1
        self.metrics.cache_invariant_violations.labels(kind=exc.kind).inc()
        self.store.detach(session, "failed", f"failed: {exc}")
        session.release()
        self.store.refresh_gauges()
        log.error("session failed", extra={"session_id": session.session_id, "violation": str(exc)})
        return SessionFailed(f"session {session.session_id!r} failed and was freed: cache invariant {exc}")

    def _check_accepting(self) -> None:
        if not self._accepting:
            raise ShuttingDown("the server is shutting down")
