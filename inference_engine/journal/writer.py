"""Feeding the journal from the event loop without blocking it: one writer thread, group commit.

Callers queue entries and, where an acknowledgement depends on it, await the commit. The writer thread takes
everything queued since its last commit and applies it as one transaction, so concurrent sessions share commits
(and, under `--journal-sync full`, fsyncs) instead of queueing behind each other's. A shared journal's take-overs
run on the same thread, in order with the writes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from inference_engine.journal.entries import (
    JournalBackend,
    JournalEntry,
    JournalError,
    JournalOpened,
    OwnershipLost,
    SessionRecord,
    SharedJournalBackend,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Batch:
    entries: list[JournalEntry]
    done: Future[None]


@dataclass(slots=True)
class _Call:
    run: Callable[[], Any]
    done: Future[Any]


class Journal:
    """A journal backend driven by a dedicated writer thread."""

    def __init__(self, backend: JournalBackend) -> None:
        self.backend = backend
        self.shared = isinstance(backend, SharedJournalBackend)
        self._queue: queue.SimpleQueue[_Batch | _Call | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kakeya-journal", daemon=True)
        self._thread.start()

    def submit(self, *entries: JournalEntry) -> Future[None]:
        """Queue entries; the future completes once they are committed (or fails with `JournalError`, with
        `OwnershipLost` when another daemon took one of their sessions over)."""
        done: Future[None] = Future()
        if self._closed:
            done.set_exception(JournalError("the session journal is closed"))
        else:
            self._queue.put(_Batch(list(entries), done))
        return done

    async def write(self, *entries: JournalEntry) -> None:
        """Queue entries and wait until they are committed."""
        await asyncio.wrap_future(self.submit(*entries))

    async def flush(self) -> None:
        """Wait until everything queued so far is committed."""
        await self.write()

    async def take_over(self, session_id: str) -> SessionRecord | None:
        """Take a session over from a shared journal (see `SharedJournalBackend.take_over`)."""
        backend = self.backend
        if not isinstance(backend, SharedJournalBackend):
            raise JournalError(f"the journal at {backend.location} is not shared: sessions cannot move to it")
        done: Future[SessionRecord | None] = Future()
        if self._closed:
            done.set_exception(JournalError("the session journal is closed"))
        else:
            self._queue.put(_Call(lambda: backend.take_over(session_id), done))
        return await asyncio.wrap_future(done)

    def close(self) -> None:
        """Commit what is queued, stop the writer thread and close the backend."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        self.backend.close()

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                break
            if isinstance(first, _Call):
                self._call(first)
                continue
            batch = [first]
            call: _Call | None = None
            while True:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                    break
                if isinstance(more, _Call):
                    call = more  # runs after the writes queued before it
                    break
                batch.append(more)
            self._commit(batch)
            if call is not None:
                self._call(call)

    def _commit(self, batch: list[_Batch]) -> None:
        entries = [entry for pending in batch for entry in pending.entries]
        try:
            refused = self.backend.write(entries)
        except Exception as exc:  # every waiter learns of the failure; the thread keeps serving
            error = exc if isinstance(exc, JournalError) else JournalError(f"journal write failed: {exc}")
            log.error("journal write failed: %s", error)
            for pending in batch:
                pending.done.set_exception(error)
            return
        for pending in batch:
            lost = sorted({_session_of(e) for e in pending.entries} & refused)
            if lost:
                pending.done.set_exception(
                    OwnershipLost(f"session {lost[0]!r} is now served by another daemon; this one's copy is stale")
                )
            else:
                pending.done.set_result(None)

    @staticmethod
    def _call(call: _Call) -> None:
        try:
            call.done.set_result(call.run())
        except Exception as exc:
            call.done.set_exception(exc)


def _session_of(entry: JournalEntry) -> str:
    return entry.header.session_id if isinstance(entry, JournalOpened) else entry.session_id
