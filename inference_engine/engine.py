"""The engine loop: one thread owns the model and the running generations.

Each turn it runs the calls queued for the model (a fork's cache copy), then

1. schedules: picks the generations to step together (`plan_batch`);
2. runs one `Decoder.step_batch` for them (one verifier forward for all);
3. post-processes each result: tallies and metrics, the journal write of its tokens, the stop rules, and a
   `StepOutput` into that generation's own queue.

The outputs of one step are handed to the event loop once the next batch is chosen, so the next forward is under way
while the consumers stream the tokens. See docs/architecture.md for the rules of scheduling.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from inference_engine.config import BATCH_WAIT_MS
from inference_engine.domain import GenerationStats, StopReason
from inference_engine.errors import ShuttingDown
from inference_engine.generation import STOP_REASONS, Generation, StepOutput, call_soon
from inference_engine.journal import Journal, JournalAppended
from inference_engine.memory import release_free_memory
from inference_engine.metrics import Metrics
from kv_cache_proposer.decoding import Decoder, StepResult

log = logging.getLogger(__name__)

T = TypeVar("T")

_POLL_S = 0.05  # how often a waiting loop with running generations re-reads their cancel events


def plan_batch(prefill_tokens: Sequence[int], *, max_batch_size: int, token_budget: int) -> list[int]:
    """Which of the ready generations (oldest first; each by the prompt tokens its step prefills) step in the next
    forward: at most `max_batch_size`, prefilling at most `token_budget` prompt tokens together. One whose prompt does
    not fit waits (and, being oldest, goes first next time) while those behind it that fit still join, so decode
    steps never wait behind a prefill."""
    chosen: list[int] = []
    prefill = 0
    for index, tokens in enumerate(prefill_tokens):
        if len(chosen) == max_batch_size:
            break
        size = min(tokens, token_budget)
        if chosen and prefill + size > token_budget:
            continue
        chosen.append(index)
        prefill += size
    return chosen


@dataclass(slots=True)
class _Call:
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]

    def run(self) -> None:
        try:
            result = self.fn()
        except BaseException as exc:  # handed to the caller
            call_soon(self.loop, _settle, self.future, None, exc)
        else:
            call_soon(self.loop, _settle, self.future, result, None)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


_Delivery = tuple[Generation, StepOutput | None, bool]  # an output (None: none) and whether the generation ended


class EngineLoop:
    """Runs every forward on one thread: queued calls, and the steps of the running generations in batches."""

    def __init__(
        self,
        decoder: Decoder,
        metrics: Metrics,
        *,
        max_batch_size: int,
        token_budget: int,
        gather_s: float = BATCH_WAIT_MS / 1000,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.decoder = decoder
        self.metrics = metrics
        self.max_batch_size = max_batch_size
        self.token_budget = token_budget
        self.gather_s = gather_s
        self.journal: Journal | None = None  # set when the runtime attaches one
        self._wake = threading.Condition()
        self._calls: list[_Call] = []  # guarded by _wake
        self._arrivals: list[Generation] = []  # guarded by _wake
        self._closing = False  # guarded by _wake
        self._running: list[Generation] = []  # the loop thread's own: oldest step first
        self._thread = threading.Thread(target=self._main, name="kakeya-engine", daemon=True)
        self._thread.start()

    # -- the event loop's side ---------------------------------------------------------------------------------
    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the engine thread between two steps. A cancelled caller still waits for a call that
        started, so it never lets go of a session the call is using."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._wake:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            self._calls.append(_Call(lambda: fn(*args), loop, future))
            self._wake.notify()
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await asyncio.wait([future])
            raise

    def begin(self, generation: Generation) -> None:
        """Start stepping `generation`; its outputs arrive in its own queue until it ends."""
        generation.on_finished = self._notify
        with self._wake:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            self._arrivals.append(generation)
            self._wake.notify()

    def close(self) -> None:
        """Finish the forward under way, end every generation with `ShuttingDown`, fail the calls not yet run."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    # -- the engine thread -------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._turns()
        except BaseException as exc:  # a fault of the loop itself: nothing could step again, so everything ends
            log.exception("the engine loop failed")
            with self._wake:
                self._closing = True
                self._running += self._arrivals
                self._arrivals.clear()
            self._shut_down(exc if isinstance(exc, Exception) else ShuttingDown("the engine loop stopped"))

    def _turns(self) -> None:
        deliveries: list[_Delivery] = []
        while True:
            with self._wake:
                calls, self._calls = self._calls, []
                self._running += self._arrivals
                self._arrivals.clear()
                closing = self._closing
            if calls or closing:
                self._deliver(deliveries)
                for call in calls:
                    call.run()
            if closing:
                self._shut_down(ShuttingDown("the server shut down"))
                return
            batch = self._schedule(deliveries)
            self._deliver(deliveries)
            if batch:
                deliveries = self._run(batch)
            else:
                self._idle()

    def _schedule(self, deliveries: list[_Delivery]) -> list[Generation]:
        """The next batch; when some running generations lag (their consumers read slowly), the batch waits for
        them up to the gather time, its earlier outputs handed out first so that they can catch up."""
        batch, ready = self._choose(deliveries)
        wanted = min(self.max_batch_size, len(self._running))
        if self.max_batch_size == 1 or not batch or ready >= wanted:
            return batch
        self._deliver(deliveries)
        deadline = time.monotonic() + self.gather_s
        while ready < wanted and (remaining := deadline - time.monotonic()) > 0:
            with self._wake:
                if self._calls or self._arrivals or self._closing:
                    break
                self._wake.wait(remaining)
            batch, ready = self._choose(deliveries)
            wanted = min(self.max_batch_size, len(self._running))
        return batch

    def _choose(self, deliveries: list[_Delivery]) -> tuple[list[Generation], int]:
        """End the generations told to stop; plan a batch of the ready ones. Returns (batch, how many were ready)."""
        for generation in [g for g in self._running if g.stopping]:
            self._running.remove(generation)
            if generation.abandoned:
                deliveries.append((generation, None, True))
            else:
                deliveries.append((generation, StepOutput(done=self._finish(generation, StopReason.CANCELLED)), True))
        ready = [g for g in self._running if g.ready]
        # a step prefills its pending tokens but the last (a decode step has none)
        prefills = [g.seq.pending_count - 1 for g in ready]
        chosen = plan_batch(prefills, max_batch_size=self.max_batch_size, token_budget=self.token_budget)
        return [ready[i] for i in chosen], len(ready)

    def _idle(self) -> None:
        """Wait for something to do: a call, a generation, a consumer catching up."""
        with self._wake:
            if self._calls or self._arrivals or self._closing:
                return
            if any(g.ready or g.stopping for g in self._running):
                return
            self._wake.wait(_POLL_S if self._running else None)

    def _run(self, batch: list[Generation]) -> list[_Delivery]:
        """One forward for the batch, and each generation's output of it."""
        started = time.perf_counter()
        metrics = self.metrics
        for generation in batch:
            metrics.batch_queue_wait_seconds.observe(max(0.0, started - generation.ready_at))
        metrics.batch_size.observe(len(batch))
        metrics.batch_forwards.inc()
        # The running order puts the generations just stepped last: the others go first next time.
        for generation in batch:
            self._running.remove(generation)
        self._running += batch
        results: Sequence[StepResult | Exception]
        prefilled = any(generation.seq.pending_count > 1 for generation in batch)
        try:
            results = self.decoder.step_batch([generation.request() for generation in batch])
        except Exception as exc:  # the decoder isolates sessions; this is a failure of the forward itself
            results = [exc] * len(batch)
        if prefilled:
            # A prefill forward grows caches (the buffers they outgrew are freed) and frees a chunk's working
            # storage: what the process keeps should follow what sessions hold, not the last forward's peak.
            release_free_memory()
        return [self._post_process(g, r) for g, r in zip(batch, results, strict=True)]

    def _post_process(self, generation: Generation, result: StepResult | Exception) -> _Delivery:
        now = time.perf_counter()
        generation.produced += 1
        generation.ready_at = now
        if isinstance(result, Exception):
            self._running.remove(generation)
            return generation, StepOutput(error=result), True
        tally = generation.tally
        tally.add(result)
        self._record_step(result)
        output = StepOutput(tokens=result.tokens, logprobs=result.logprobs)
        if result.tokens:
            self.metrics.generate_tokens.inc(len(result.tokens))
            if tally.first_token_at is None:
                tally.first_token_at = now
                self._record_prefill(generation)
                output.truncated = generation.seq.cache.footprint().lost_count
            if self.journal is not None:
                entry = JournalAppended(generation.session_id, tuple(result.tokens), time.time())
                output.journaled = self.journal.submit(entry)
        if result.stop is None:
            return generation, output, False
        self._running.remove(generation)
        try:
            generation.before_done()
        except Exception:  # what it keeps is a cache (the K/V files): the generation still ends as it did
            log.warning(
                "work before a generation's Done failed", extra={"session_id": generation.session_id}, exc_info=True
            )
        output.done = self._finish(generation, STOP_REASONS[result.stop])
        return generation, output, True

    def _finish(self, generation: Generation, reason: StopReason) -> GenerationStats:
        tally = generation.tally
        if tally.first_token_at is None:
            self._record_prefill(generation)
        stats = tally.stats(reason, time.perf_counter())
        if stats.generated_token_count:
            self.metrics.generate_verifier_forwards_per_token.observe(
                stats.verifier_forward_count / stats.generated_token_count
            )
        log.info(
            "generation done",
            extra={
                "session_id": generation.session_id,
                "stop_reason": reason.value,
                "generated": stats.generated_token_count,
                "prefill_tokens": stats.prefill_token_count,
                "duration_s": round(stats.total_duration_s, 4),
            },
        )
        return stats

    @staticmethod
    def _deliver(deliveries: list[_Delivery]) -> None:
        for generation, output, ended in deliveries:
            if output is not None:
                generation.push(output)
            if ended:
                generation.end()
        deliveries.clear()

    def _shut_down(self, refusal: Exception) -> None:
        """End every generation and fail every call not yet run with `refusal`."""
        with self._wake:
            calls, self._calls = self._calls, []
        for call in calls:
            call_soon(call.loop, _settle, call.future, None, refusal)
        for generation in self._running:
            generation.push(StepOutput(error=refusal))
            generation.end()
        self._running.clear()

    def _record_step(self, step: StepResult) -> None:
        metrics = self.metrics
        metrics.verifier_forwards.inc(step.forwards)
        if step.decision is not None:
            metrics.speculative_decisions.labels(decision=step.decision.value).inc()
        if step.drafted:
            metrics.speculative_drafts.inc()
            metrics.speculative_draft_tokens.inc(step.drafted)
            metrics.speculative_accepted_tokens.inc(step.accepted)
            metrics.speculative_acceptance_length.observe(step.accepted)

    def _record_prefill(self, generation: Generation) -> None:
        tally = generation.tally
        end = tally.first_token_at if tally.first_token_at is not None else time.perf_counter()
        self.metrics.generate_prefill_tokens.observe(tally.prefill_tokens)
        self.metrics.generate_prefill_duration_seconds.observe(end - tally.started)
        if tally.first_token_at is not None:
            self.metrics.generate_time_to_first_token_seconds.observe(end - tally.started)
