"""A generation's event-loop side: its turn, its start on the engine loop, each step's output checked before the
tokens reach the client (a failed step fails the session, the tokens must be journaled, the KV budget must hold),
and its end, once the engine is done with it and every token it added to the history is journaled."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from inference_engine.admission import Admission
from inference_engine.durability import SessionJournal
from inference_engine.durable_kv import DurableKV
from inference_engine.engine import EngineLoop
from inference_engine.errors import ServiceError, ShuttingDown
from inference_engine.generation import Generation, StepOutput
from inference_engine.journal import JournalError
from inference_engine.memory import release_free_memory
from inference_engine.metrics import Metrics
from inference_engine.prefix_reuse import PrefixReuse
from inference_engine.sessions import Session, SessionStore
from kv_cache_proposer.controls import DecodeControls
from kv_cache_proposer.decoding import GenerationBudget
from kv_cache_proposer.errors import InvariantViolation
from kv_cache_proposer.sampling import SamplingParams

log = logging.getLogger(__name__)

_GAUGE_INTERVAL_S = 0.25  # how stale the KV gauges may get while a generation runs (they are exact once it ends)


class GenerationStreams:
    """Runs generations on the engine loop for the runtime and checks what each step gives them."""

    def __init__(
        self,
        engine: EngineLoop,
        store: SessionStore,
        admission: Admission,
        journal: SessionJournal,
        metrics: Metrics,
        *,
        resting_sessions: int = 0,
    ) -> None:
        """`resting_sessions`: how many sessions that generated last keep their generating form between generations
        (`SessionCache.rest`); the others park."""
        self.engine = engine
        self.store = store
        self.admission = admission
        self.journal = journal
        self.metrics = metrics
        self.prefix_reuse = PrefixReuse(store, engine, metrics)
        self.resting_sessions = resting_sessions
        self._resting: OrderedDict[str, Session] = OrderedDict()  # sessions that rested, least recent first

    @asynccontextmanager
    async def turn(self, session: Session) -> AsyncIterator[None]:
        """A generation turn (`Admission.generation_turn`), with the wait counted in the queue depth and queue wait
        metrics."""
        queued_at = time.perf_counter()
        waiting = True
        self.metrics.generate_queue_depth.inc()
        try:
            async with self.admission.generation_turn(session):
                waiting = False
                self.metrics.generate_queue_depth.dec()
                self.metrics.generate_queue_wait_seconds.observe(time.perf_counter() - queued_at)
                yield
        finally:
            if waiting:
                self.metrics.generate_queue_depth.dec()

    @asynccontextmanager
    async def running(
        self,
        session: Session,
        sampling: SamplingParams,
        budget: GenerationBudget,
        controls: DecodeControls,
        cancel: asyncio.Event | None,
    ) -> AsyncIterator[Generation]:
        """The generation of a session that holds its turn, running on the engine loop; on exit the engine is done
        with it, every token it added to the history is journaled and the session parks."""
        seq = session.seq
        session.cancel = cancel or asyncio.Event()
        session.generating = True
        self.metrics.session_history_tokens.observe(len(seq.tokens))
        kv = self.journal.kv
        if kv is not None and kv.awaits(session.session_id):
            await self._read_back(session, kv)
        if not seq.committed:
            await self.prefix_reuse.reuse(session)
        generation = Generation(session.session_id, seq, sampling, budget, controls, session.cancel)
        if kv is not None:  # the K/V of a finished turn are on disk before its Done reaches the client
            generation.before_done = partial(self._write_kv, kv, session)
        try:
            self.engine.begin(generation)
            yield generation
        finally:
            # Runs to its end even when the client's call is cancelled meanwhile (as a client that read Done and
            # let go of the call does): a session left marked generating, or not parked, would stay so.
            await run_to_end(self._wind_up(session, generation))

    async def _wind_up(self, session: Session, generation: Generation) -> None:
        """The end of a generation: once the engine is done with it, a step under way when the consumer left
        completes, its tokens journaled as history; then the session parks."""
        if not generation.has_ended and session.cancel is not None:
            session.cancel.set()  # a GetSessionInfo that is settling cancellations now waits for this end
        for output in await self._stop(generation):
            try:
                await self.take(session, generation, output)
            except ServiceError:
                break  # the session failed and was freed; the generation already ends with its own error
            except Exception:  # the generation already ends with its own error; this step's is the same session's
                log.debug("a step of an ended generation failed", exc_info=True)
                break
        session.generating = False
        session.cancel = None
        try:
            await self._park(session)
        finally:
            self.store.touch(session)
            self.store.charge(session)
            self.store.refresh_gauges()
            session.finishing = False

    async def _park(self, session: Session) -> None:
        """Between generations the session holds only its resident storage, and the memory it freed goes back to
        the system (`release_free_memory`). A compressed session that attended its history as lattice coordinates
        packs them again (tenths of a second at 8k tokens) unless it is one of the `resting_sessions` that generated
        last: it rests, keeping them (`SessionCache.rest`), and the session that falls out of those parks. This runs
        on the engine thread between two steps, not on the event loop; each session keeps its turn meanwhile, so
        nothing else reads or evicts it."""
        cache = session.seq.cache
        kv = self.journal.kv
        self._resting.pop(session.session_id, None)

        def parked() -> bool:
            rested = False
            if self.resting_sessions:
                rested = cache.rest()
            else:
                cache.park()
            if kv is not None:  # a generation that ended without Done (cancelled, failed) writes its K/V here
                self._write_kv(kv, session)
            release_free_memory()
            return rested

        try:
            if await self.engine.call(parked):
                self._resting[session.session_id] = session
            await self._park_resting()
        except ShuttingDown:
            cache.park()  # the engine takes no more calls, and is done with this session's cache

    async def _park_resting(self) -> None:
        """Park the sessions that rested beyond the `resting_sessions` that generated last (their coordinates packed,
        on the engine thread), each holding its turn; one that is busy now parks or rests when its turn ends."""
        overflow = len(self._resting) - self.resting_sessions
        for session in list(self._resting.values())[: max(0, overflow)]:
            if session.closed:
                self._resting.pop(session.session_id, None)
            elif not session.busy:
                self._resting.pop(session.session_id, None)
                async with self.admission.session_turn(session):
                    await self.engine.call(self._park_now, session)
                self.store.charge(session)

    @staticmethod
    def _park_now(session: Session) -> None:
        session.seq.cache.park()
        release_free_memory()

    def _write_kv(self, kv: DurableKV, session: Session) -> None:
        """Write the K/V the session committed since its last write (`DurableKV.save`); on the engine thread."""
        self.metrics.session_kv_written_positions.inc(kv.save(session))

    async def _read_back(self, session: Session, kv: DurableKV) -> None:
        """The first generation of a session restored from the journal reads back the K/V it left in its files
        (`DurableKV.load`), on the engine thread; what they do not hold is prefilled."""
        try:
            positions = await self.engine.call(kv.load, session)
        except Exception:  # the files are a cache of the journal: the history is prefilled instead
            log.warning("K/V files not read back", extra={"session_id": session.session_id}, exc_info=True)
            positions = 0
        self.metrics.session_kv_read_back_positions.inc(positions)

    async def take(self, session: Session, generation: Generation, output: StepOutput) -> None:
        """Check one step's output before its tokens reach the client: a failed step fails the session, and the
        tokens must be journaled (else the session fails, once the engine let go of it: its memory and journal would
        disagree)."""
        if isinstance(output.error, InvariantViolation):
            raise self.store.fail(session, output.error) from output.error
        if output.error is not None:
            raise output.error
        if output.journaled is not None:
            try:
                await asyncio.wrap_future(output.journaled)
            except JournalError as exc:
                await self._stop(generation)
                raise self.journal.fail_unjournaled(session, exc) from exc

    def within_budget(self, session: Session) -> bool:
        """After a step: the session counts as used now, and idle sessions are evicted while the KV bytes are over
        the budget; whether they fit."""
        self.store.touch(session)
        within = self.store.enforce_budget(protect=session)
        self.store.refresh_gauges_every(_GAUGE_INTERVAL_S)
        return within

    async def settle_cancellations(self, session_id: str, *, window_s: float, timeout_s: float) -> None:
        """Let a cancellation sent just before this call end the session's generation (see
        `Runtime.settle_cancellations`): a running generation delays the caller by at most `window_s`, a cancelled
        one by the rest of its current step (at most `timeout_s`). A generation that already sent its Done delays
        the caller until the session has parked (at most `timeout_s`), so what a client reads right after a
        generation is the parked session."""
        try:
            session = self.store.get(session_id, touch=False)
        except ServiceError:
            return  # the caller's own lookup reports the error
        deadline = time.monotonic() + timeout_s
        while session.finishing and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        deadline = time.monotonic() + window_s
        while session.generating and time.monotonic() < deadline:
            if session.cancel is not None and session.cancel.is_set():
                deadline = time.monotonic() + timeout_s
                while session.generating and time.monotonic() < deadline:
                    await asyncio.sleep(0.002)
                return
            await asyncio.sleep(0.001)

    @staticmethod
    async def _stop(generation: Generation) -> list[StepOutput]:
        """Take no further step for `generation` and wait until the engine is done with it; the outputs nobody
        read (empty when they were taken already)."""
        if not generation.has_ended:
            generation.abandon()
        return await generation.ended()


async def run_to_end(work: Coroutine[Any, Any, None]) -> None:
    """Await `work`; when the caller is cancelled meanwhile, `work` still runs to its end before the cancellation
    is raised (what it raises then is logged, not lost)."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            log.warning("cleanup after a cancelled call failed", exc_info=task.exception())
        raise
