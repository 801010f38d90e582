"""Serving the sessions of a journal shared by several daemons (`--journal-url`).

A proxy in front of the daemons sends every call of a session to one daemon (it hashes the session's routing key),
so a daemon normally holds every session it is asked about. When it does not, because the daemon that held the
session died, drained, or the proxy's ring changed, it takes the session over from the shared journal: the
ownership record moves to it atomically and its history comes back pending, so the next generation rebuilds the K/V
by prefill. The daemon that held the session before loses it at its next journal write (`OwnershipLost`) and drops
its stale copy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

from inference_engine.errors import JournalUnavailable, SessionFailed, SessionNotFound
from inference_engine.journal import Journal, JournalDamaged, JournalError, SessionRecord
from inference_engine.sessions import Session, SessionStore

log = logging.getLogger(__name__)

_TAKEOVER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ClusterMetrics:
    """Counters of sessions moving between the daemons of a cluster."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.takeovers = Counter(
            "kakeya_cluster_session_takeovers",
            "Sessions this daemon took over from the shared journal (their K/V rebuilt by the next prefill)",
            registry=registry,
        )
        self.ownership_lost = Counter(
            "kakeya_cluster_sessions_lost",
            "Sessions this daemon dropped because another daemon had taken them over",
            registry=registry,
        )
        self.takeover_duration_seconds = Histogram(
            "kakeya_cluster_takeover_duration_seconds",
            "Wall time of a take-over: moving the ownership record and reading the history",
            buckets=_TAKEOVER_BUCKETS,
            registry=registry,
        )


class SessionTakeovers:
    """Finds a session in the store, or takes it over from the shared journal. Runs on the event loop."""

    def __init__(
        self,
        journal: Journal,
        store: SessionStore,
        restore: Callable[[SessionRecord], Session],
        metrics: ClusterMetrics,
    ) -> None:
        self.journal = journal
        self.store = store
        self.metrics = metrics
        self._restore = restore
        self._locks: dict[str, asyncio.Lock] = {}  # one take-over at a time per session id

    async def acquire(self, session_id: str, *, touch: bool = True) -> Session:
        """The session, held by this daemon from now on; `NOT_FOUND` when the shared journal has no such session."""
        try:
            return self.store.get(session_id, touch=touch)
        except SessionNotFound as missing:
            not_found = missing
        lock = self._locks.setdefault(session_id, asyncio.Lock())
        try:
            async with lock:
                try:  # another call may have taken it over while this one waited
                    return self.store.get(session_id, touch=touch)
                except SessionNotFound:
                    pass
                return await self._take_over(session_id, not_found)
        finally:
            if not lock.locked():
                self._locks.pop(session_id, None)

    def drop_lost(self, session_id: str) -> None:
        """Drop this daemon's copy of a session another daemon has taken over (its journal writes were refused)."""
        try:
            session = self.store.get(session_id, touch=False)
        except SessionNotFound:
            return
        self.store.detach(session, "moved", "moved: another daemon took it over")
        if session.cancel is not None:
            session.cancel.set()
        session.release()
        self.store.refresh_gauges()
        self.metrics.ownership_lost.inc()
        log.warning("session taken over by another daemon; local copy dropped", extra={"session_id": session_id})

    async def _take_over(self, session_id: str, not_found: SessionNotFound) -> Session:
        started = time.perf_counter()
        try:
            record = await self.journal.take_over(session_id)
        except JournalError as exc:
            raise JournalUnavailable(f"cannot reach the shared session journal to find {session_id!r}: {exc}") from exc
        if record is None:
            raise not_found
        try:  # a take-over of the same id that overlapped this one already brought it back
            return self.store.get(session_id)
        except SessionNotFound:
            pass
        try:
            session = self._restore(record)
        except JournalDamaged as exc:
            raise SessionFailed(f"{exc}; the session cannot be served by this daemon") from None
        elapsed = time.perf_counter() - started
        self.metrics.takeovers.inc()
        self.metrics.takeover_duration_seconds.observe(elapsed)
        log.info(
            "session taken over from the shared journal",
            extra={"session_id": session_id, "history": len(record.tokens), "duration_s": round(elapsed, 4)},
        )
        return session
