"""The session journal behind `--state-dir`: every session's creation, appended and generated tokens, and end,
written durably as they happen, so neither a restart nor a crash loses an acknowledged token.

`JournalBackend` is the storage (one class per database: SQLite under `--state-dir`, PostgreSQL shared by a cluster
under `--journal-url`); `Journal` feeds it from the event loop through one writer thread that commits queued entries
together; `open_journal` / `open_shared_journal` open the configured backend and read its sessions.
"""

from inference_engine.journal.entries import (
    JournalAppended,
    JournalBackend,
    JournalDamaged,
    JournalEnded,
    JournalEntry,
    JournalError,
    JournalOpened,
    OwnershipLost,
    SessionHeader,
    SessionRecord,
    SharedJournalBackend,
)
from inference_engine.journal.opening import OpenedJournal, open_journal, open_shared_journal
from inference_engine.journal.writer import Journal

__all__ = [
    "Journal",
    "JournalAppended",
    "JournalBackend",
    "JournalDamaged",
    "JournalEnded",
    "JournalEntry",
    "JournalError",
    "JournalOpened",
    "OpenedJournal",
    "OwnershipLost",
    "SessionHeader",
    "SessionRecord",
    "SharedJournalBackend",
    "open_journal",
    "open_shared_journal",
]
