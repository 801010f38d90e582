"""The step scheduler: the steps of concurrent generations are batched and run together in one verifier forward.

Each running generation hands its next step to the `StepScheduler` and awaits the result. One dispatcher task on the
event loop forms batches and runs each on the model worker (`Decoder.step_batch`: one forward for all of them).

Batch forming, in order:

- Gathering: once a step is queued the dispatcher waits until every running generation has queued its next step
  (each does so as soon as it has streamed its previous tokens), up to `max_batch_size` steps, or for at most
  `gather_s`: a generation whose client reads slowly delays the others by no more than that.
- Fairness: steps are taken in arrival order, at most `max_batch_size` per forward. A forward prefills at most
  `token_budget` prompt tokens (the prefill chunk size; a step's prompt tokens are its pending tokens but the last,
  so a decode step has none): a step whose prompt tokens do not fit waits at the head of the queue and goes first
  in the next forward, while decode steps and smaller prefills behind it still join this one. A long prompt is
  prefilled one chunk per forward, so it slows the forwards that carry the other sessions' tokens by at most one
  chunk's work, and decode steps never wait behind a prefill.

With `max_batch_size` 1 every step runs alone, in arrival order, with no gathering (one forward per step).

Chaining: a generation that steps alone (no other generation running, no other step queued, no other call waiting
for the model worker) has its next step started by the worker as soon as the current one returns, without a round
trip through the event loop: the step's result goes to the event loop, and the worker runs its successor meanwhile.
The worker chains only after a step whose generation submitted it with its cancel event and already awaits its
result (`StepTicket.chain`: it has handed out every earlier token), and not when the step ended the generation (a
stop rule, an error), when the event is set, or when another generation or call needs the worker. So a generation
is one step ahead of its stream at most, as without chaining: a slow reader does not let the history run ahead of
what it streamed, and a cancellation stops it after the step under way. A generation's first token step is not
chained, since the generation then reads its session's cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from inference_engine.metrics import Metrics
from inference_engine.worker import ModelWorker
from kv_cache_proposer.decoding import Decoder, StepRequest, StepResult

_GATHER_S = 0.005


@dataclass(slots=True, eq=False)
class StepTicket:
    """A submitted step (`StepScheduler.submit`), or one the worker chained after it (`StepTicket.chained`)."""

    request: StepRequest
    future: asyncio.Future[StepResult]  # awaited by the generation; cancelled with its task or when withdrawn
    queued_at: float = field(default_factory=time.perf_counter)
    cancel: asyncio.Event | None = None  # the generation's cancel event; None: never chained
    chain: bool = False  # whether the worker may start this step's successor right after it (`result` sets it)
    chained: StepTicket | None = None  # the successor the worker started (set before this step's result)
    outcome: StepResult | BaseException | None = None  # set once the step ran, or will never run
    settled: asyncio.Future[None] | None = None  # made by a caller waiting for `outcome`, resolved with it

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens this step prefills: its pending tokens but the last (a decode step has none)."""
        return self.request.seq.pending_count - 1


class StepScheduler:
    """Schedules the steps of concurrent generations into batches and runs each on the model worker, several steps
    per forward."""

    def __init__(
        self,
        worker: ModelWorker,
        decoder: Decoder,
        metrics: Metrics,
        *,
        max_batch_size: int,
        token_budget: int,
        gather_s: float = _GATHER_S,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self._worker = worker
        self._decoder = decoder
        self._metrics = metrics
        self.max_batch_size = max_batch_size
        self._token_budget = token_budget
        self._gather_s = gather_s
        self._queue: list[StepTicket] = []
        self._arrived: asyncio.Event | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._generations = 0  # generations between their first and last step (queued or streaming)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.started_steps = 0  # steps submitted or chained so far

    @property
    def queued_steps(self) -> int:
        """Steps submitted and not yet in a forward."""
        return len(self._queue)

    def begin_generation(self) -> None:
        """Count a running generation: the dispatcher gathers until each running one has queued its step."""
        self._generations += 1

    def end_generation(self) -> None:
        """The generation counted by `begin_generation` takes no more steps."""
        self._generations -= 1
        if self._arrived is not None:
            self._arrived.set()  # one fewer step to wait for

    async def step(self, request: StepRequest, on_cancel: asyncio.Event) -> StepResult:
        """Run one step in the next batch that takes it; raises what the step raised.

        If the awaiting task is cancelled, `on_cancel` is set at once; a step not yet in a forward is dropped,
        one in a forward completes first (so the session is never released while the worker mutates it).
        """
        return await self.result(self.submit(request), on_cancel)

    def submit(self, request: StepRequest, cancel: asyncio.Event | None = None) -> StepTicket:
        """Queue one step now; `result` awaits it, `withdraw` takes it back while it waits. With the generation's
        `cancel` event, the worker may chain the generation's next steps after it (see the module doc)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        if self._arrived is None:
            self._arrived = asyncio.Event()
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = loop.create_task(self._dispatch(), name="kakeya-step-scheduler")
        queued = StepTicket(request, loop.create_future(), cancel=cancel)
        self._queue.append(queued)
        self.started_steps += 1
        self._arrived.set()
        return queued

    async def result(self, queued: StepTicket, on_cancel: asyncio.Event) -> StepResult:
        """The result of a submitted or chained step (see `step`); the step's `chained` successor, if any, is set
        by the time it returns. Awaiting it lets the worker chain the step's successor: the caller is done with the
        results before it."""
        queued.chain = queued.cancel is not None
        # The step's future is awaited directly (no shield, no task around it): the generation wakes in the event
        # loop's next pass after the result comes, and each pass costs the model worker a turn of the GIL.
        try:
            return await queued.future
        except asyncio.CancelledError:
            on_cancel.set()
            if not self.withdraw(queued):
                with contextlib.suppress(Exception):  # the caller is gone; the step's error goes with it
                    await self.settled(queued)
            raise

    async def settled(self, queued: StepTicket) -> StepResult | None:
        """Wait until the step ran (or will never run); its result, None when it never ran, raising what it
        raised. The awaiting task's own cancellation is not passed on to the step."""
        if queued.outcome is None:
            assert self._loop is not None
            queued.settled = queued.settled or self._loop.create_future()
            await asyncio.wait([queued.settled])
        outcome = queued.outcome
        if queued.future.done() and not queued.future.cancelled():
            queued.future.exception()  # retrieved here, whether or not `result` was awaited
        if isinstance(outcome, asyncio.CancelledError):
            return None
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def withdraw(self, queued: StepTicket) -> bool:
        """Take a submitted step out of the queue if it has not reached a forward (its `result` then raises
        `CancelledError`); False when it is in a forward or done."""
        if queued not in self._queue:
            return False
        self._queue.remove(queued)
        self._settle(queued, asyncio.CancelledError())
        return True

    def close(self) -> None:
        """Stop the dispatcher (the batch in flight completes on the worker, and chains no further) and cancel the
        steps still queued."""
        self._closed = True
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        for queued in self._queue:
            self._settle(queued, asyncio.CancelledError())
        self._queue.clear()

    async def _dispatch(self) -> None:
        assert self._arrived is not None
        while True:
            while not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            if self.max_batch_size > 1:
                await self._gather()
            batch = self._select()
            if not batch:
                continue  # the gathered steps were all cancelled
            started = time.perf_counter()
            for queued in batch:
                self._metrics.batch_queue_wait_seconds.observe(started - queued.queued_at)
            self._metrics.batch_size.observe(len(batch))
            self._metrics.batch_forwards.inc()
            try:
                await self._worker.run(self._run, batch)
            except asyncio.CancelledError:
                for queued in batch:
                    if queued.outcome is None:
                        self._settle(queued, asyncio.CancelledError())
                raise
            except Exception as exc:  # the worker itself failed (shut down): every step of the batch fails
                for queued in batch:
                    if queued.outcome is None:
                        self._settle(queued, exc)
                continue

    def _run(self, batch: Sequence[StepTicket]) -> None:
        """On the worker: one forward for the batch, then, for a step that may chain, its successors one by one;
        every result goes to the event loop as soon as it is known."""
        assert self._loop is not None
        results = self._decoder.step_batch([queued.request for queued in batch])
        if len(batch) == 1:
            queued, result = batch[0], results[0]
            while (successor := self._successor(queued, result)) is not None:
                self._loop.call_soon_threadsafe(self._deliver, queued, result, successor)
                queued = successor
                try:
                    result = self._decoder.step_batch([queued.request])[0]
                except Exception as exc:  # its generation gets the error, as for a batch whose forward failed
                    result = exc
            batch, results = [queued], [result]
        for queued, result in zip(batch, results, strict=True):
            self._loop.call_soon_threadsafe(self._deliver, queued, result, None)

    def _successor(self, queued: StepTicket, result: StepResult | Exception) -> StepTicket | None:
        """On the worker: the step to chain after `queued`, or None (see the module doc)."""
        if not queued.chain or queued.cancel is None or queued.cancel.is_set() or self._closed:
            return None
        if isinstance(result, Exception) or result.stop is not None:
            return None
        if result.tokens and queued.request.generated == 0:
            return None  # the generation's first token: it reads the session's cache before its next step runs
        if self._queue or self._generations > 1 or self._worker.backlog:
            return None  # another generation or call needs the worker: back to the dispatcher
        assert self._loop is not None
        request = dataclasses.replace(queued.request, generated=queued.request.generated + len(result.tokens))
        return StepTicket(request, self._loop.create_future(), cancel=queued.cancel)

    def _deliver(self, queued: StepTicket, result: StepResult | Exception, successor: StepTicket | None) -> None:
        """On the event loop: a step's result, and the successor chained after it."""
        if successor is not None:
            queued.chained = successor
            self.started_steps += 1
            self._metrics.batch_queue_wait_seconds.observe(0.0)
            self._metrics.batch_size.observe(1)
            self._metrics.batch_forwards.inc()
        self._settle(queued, result)

    @staticmethod
    def _settle(queued: StepTicket, outcome: StepResult | BaseException) -> None:
        """Record what became of a step and wake whoever waits for it."""
        queued.outcome = outcome
        if not queued.future.done():
            if isinstance(outcome, asyncio.CancelledError):
                queued.future.cancel()
            elif isinstance(outcome, BaseException):
                queued.future.set_exception(outcome)
            else:
                queued.future.set_result(outcome)
        if queued.settled is not None and not queued.settled.done():
            queued.settled.set_result(None)

    async def _gather(self) -> None:
        """Wait (up to the gather time) until every running generation has queued a step, or the batch is full."""
        assert self._arrived is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._gather_s
        while len(self._queue) < min(self.max_batch_size, max(self._generations, 1)):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._arrived.wait()
            if not self._queue:
                return

    def _select(self) -> list[StepTicket]:
        """The next batch, in arrival order within the batch size and token budget (see the module doc)."""
        batch: list[StepTicket] = []
        prefill = 0
        for queued in self._queue:
            if len(batch) == self.max_batch_size:
                break
            size = min(queued.prefill_tokens, self._token_budget)
            if batch and prefill + size > self._token_budget:
                continue
            batch.append(queued)
            prefill += size
        for queued in batch:
            self._queue.remove(queued)
        return batch
