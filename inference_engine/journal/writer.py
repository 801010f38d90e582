"""Feeding the journal from the event loop without blocking it: one writer thread, group commit.

Callers queue entries and, where an acknowledgement depends on it, await the commit. The writer thread takes
everything queued since its last commit and applies it as one transaction, so concurrent sessions share commits
(and, under `--journal-sync full`, fsyncs) instead of queueing behind each other's.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future

from inference_engine.journal.entries import JournalBackend, JournalEntry, JournalError

log = logging.getLogger(__name__)

_Batch = tuple[list[JournalEntry], "Future[None]"]


class Journal:
    """A journal backend driven by a dedicated writer thread."""

    def __init__(self, backend: JournalBackend) -> None:
        self.backend = backend
        self._queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kakeya-journal", daemon=True)
        self._thread.start()

    def submit(self, *entries: JournalEntry) -> Future[None]:
        """Queue entries; the future completes once they are committed (or fails with `JournalError`)."""
        done: Future[None] = Future()
        if self._closed:
            done.set_exception(JournalError("the session journal is closed"))
        else:
            self._queue.put((list(entries), done))
        return done

    async def write(self, *entries: JournalEntry) -> None:
        """Queue entries and wait until they are committed."""
        await asyncio.wrap_future(self.submit(*entries))

    async def flush(self) -> None:
        """Wait until everything queued so far is committed."""
        await self.write()

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
            batch = [first]
            while True:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                    break
                batch.append(more)
            entries = [entry for pending, _ in batch for entry in pending]
            try:
                self.backend.write(entries)
            except Exception as exc:  # every waiter learns of the failure; the thread keeps serving
                error = exc if isinstance(exc, JournalError) else JournalError(f"journal write failed: {exc}")
                log.error("journal write failed: %s", error)
                for _, done in batch:
                    done.set_exception(error)
                continue
            for _, done in batch:
                done.set_result(None)
