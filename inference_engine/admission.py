"""Admission: one request at a time per session (FIFO) and at most `max_concurrent` generations overall (FIFO),
each admitted within the queue deadline or refused."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from inference_engine.errors import ResourceExhausted, SessionNotFound
from inference_engine.sessions import Session


class FifoSlots:
    """A counting semaphore that hands slots out strictly in arrival order."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self._free = slots
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    async def acquire(self) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed over as we were cancelled: pass it on
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1


class Admission:
    """Admits requests: grants turns on sessions and generation slots, each within the queue deadline."""

    def __init__(self, *, max_concurrent: int, queue_deadline_s: float) -> None:
        self.slots = FifoSlots(max_concurrent)
        self.queue_deadline_s = queue_deadline_s

    @asynccontextmanager
    async def session_turn(self, session: Session, deadline: float | None = None) -> AsyncIterator[None]:
        """Hold the session exclusively (appends, generations), waiting in FIFO order until `deadline`
        (event-loop time; default: the queue deadline from now)."""
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + self.queue_deadline_s
        session.queued += 1
        try:
            await _acquire_by(
                session.lock.acquire,
                deadline,
                f"session {session.session_id!r} stayed busy for the {self.queue_deadline_s:g} s queue deadline",
            )
            try:
                if session.closed:
                    raise SessionNotFound(f"session {session.session_id!r} was closed while this request waited")
                yield
            finally:
                session.lock.release()
        finally:
            session.queued -= 1

    @asynccontextmanager
    async def generation_turn(self, session: Session) -> AsyncIterator[None]:
        """Hold the session and one of the global generation slots."""
        deadline = asyncio.get_running_loop().time() + self.queue_deadline_s
        async with self.session_turn(session, deadline):
            await _acquire_by(
                self.slots.acquire,
                deadline,
                f"no generation slot freed within the {self.queue_deadline_s:g} s queue deadline",
            )
            try:
                yield
            finally:
                self.slots.release()


async def _acquire_by(acquire: Callable[[], Awaitable[object]], deadline: float, refusal: str) -> None:
    """`acquire()` by `deadline` (event-loop time), or refuse with ResourceExhausted(`refusal`)."""
    try:
        async with asyncio.timeout_at(deadline):
            await acquire()
    except TimeoutError:
        raise ResourceExhausted(refusal) from None
