"""Batched decode steps: the steps of concurrent generations run together in one verifier forward.

Each running generation hands its next step to the `StepBatcher` and awaits the result. One dispatcher task on the
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
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from inference_engine.metrics import Metrics
from inference_engine.worker import ModelWorker
from kv_cache_proposer.decoding import Decoder, StepRequest, StepResult

_GATHER_S = 0.005


@dataclass(slots=True, eq=False)
class _Queued:
    request: StepRequest
    future: asyncio.Future[StepResult]
    queued_at: float = field(default_factory=time.perf_counter)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens this step prefills: its pending tokens but the last (a decode step has none)."""
        return self.request.seq.pending_count - 1


StepTicket = _Queued
"""A submitted step (`StepBatcher.submit`)."""


class StepBatcher:
    """Runs the steps of concurrent generations on the model worker, several per forward."""

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
        self._queue: list[_Queued] = []
        self._arrived: asyncio.Event | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._generations = 0  # generations between their first and last step (queued or streaming)

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

    def submit(self, request: StepRequest) -> StepTicket:
        """Queue one step now; `result` awaits it, `withdraw` takes it back while it waits."""
        loop = asyncio.get_running_loop()
        if self._arrived is None:
            self._arrived = asyncio.Event()
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = loop.create_task(self._dispatch(), name="kakeya-step-batcher")
        queued = _Queued(request, loop.create_future())
        self._queue.append(queued)
        self._arrived.set()
        return queued

    async def result(self, queued: StepTicket, on_cancel: asyncio.Event) -> StepResult:
        """The result of a submitted step (see `step`)."""
        try:
            return await asyncio.shield(queued.future)
        except asyncio.CancelledError:
            on_cancel.set()
            if queued in self._queue:
                self._queue.remove(queued)
                queued.future.cancel()
            else:
                await asyncio.wait([queued.future])
                if not queued.future.cancelled():
                    queued.future.exception()  # retrieved: the caller is gone
            raise

    def withdraw(self, queued: StepTicket) -> bool:
        """Take a submitted step out of the queue if it has not reached a forward (its `result` then raises
        `CancelledError`); False when it is in a forward or done."""
        if queued not in self._queue:
            return False
        self._queue.remove(queued)
        queued.future.cancel()
        return True

    def close(self) -> None:
        """Stop the dispatcher (the batch in flight completes on the worker) and cancel the steps still queued."""
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        for queued in self._queue:
            queued.future.cancel()
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
                results = await self._worker.run(self._decoder.step_batch, [queued.request for queued in batch])
            except asyncio.CancelledError:
                for queued in batch:
                    queued.future.cancel()
                raise
            except Exception as exc:  # the worker itself failed (shut down): every step of the batch fails
                for queued in batch:
                    if not queued.future.done():
                        queued.future.set_exception(exc)
                continue
            for queued, result in zip(batch, results, strict=True):
                if queued.future.done():
                    continue
                if isinstance(result, Exception):
                    queued.future.set_exception(result)
                else:
                    queued.future.set_result(result)

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

    def _select(self) -> list[_Queued]:
        """The next batch, in arrival order within the batch size and token budget (see the module doc)."""
        batch: list[_Queued] = []
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
