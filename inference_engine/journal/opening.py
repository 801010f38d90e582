"""Opening the journal at start: the model check, the explicit choice a damaged journal needs, and the shutdown
snapshot (`sessions.json`) that earlier versions wrote, taken over once."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference_engine.journal.entries import JournalDamaged, JournalError, JournalOpened, SessionHeader, SessionRecord
from inference_engine.journal.sqlite import SqliteJournal
from inference_engine.journal.writer import Journal

RECOVERY_CHOICES = ("refuse", "salvage")
LEGACY_SNAPSHOT = "sessions.json"


@dataclass
class OpenedJournal:
    """A journal ready for writes, the sessions it holds, and what a salvage dropped (empty when none ran)."""

    journal: Journal
    records: list[SessionRecord]
    dropped: list[str] = field(default_factory=list)
    moved_to: Path | None = None


def open_journal(directory: Path, model: Mapping[str, Any], *, sync: str, recovery: str) -> OpenedJournal:
    """Open (or create) the SQLite journal in `directory` and read its sessions.

    A damaged journal raises `JournalDamaged` unless `recovery` is `salvage`: then it is moved aside, the sessions
    that still read back are kept, and `dropped` says what was lost.
    """
    if recovery not in RECOVERY_CHOICES:
        raise ValueError(f"recovery must be one of {', '.join(RECOVERY_CHOICES)}, got {recovery!r}")
    try:
        backend = SqliteJournal(directory, sync=sync)
        records = backend.load(model)
    except JournalDamaged as exc:
        if recovery != "salvage":
            raise JournalDamaged(
                f"{exc}. Nothing was changed; start with --journal-recovery salvage to move the file aside and "
                "keep the sessions that still read back"
            ) from None
        records, dropped, aside = SqliteJournal.salvage(directory)
        backend = SqliteJournal(directory, sync=sync)
        backend.load(model)
        backend.write([JournalOpened(r.header, tuple(r.tokens), r.last_active_unix) for r in records])
        return OpenedJournal(Journal(backend), records, dropped, aside)
    legacy = _take_over_snapshot(directory, model, backend)
    return OpenedJournal(Journal(backend), records + legacy)


def open_shared_journal(url: str, model: Mapping[str, Any], *, node: str, sync: str) -> OpenedJournal:
    """Connect to the PostgreSQL journal at `url` as the daemon named `node`, creating its tables when needed.

    No session comes back at start: each one moves to the daemon its next call reaches (`Journal.take_over`).
    """
    from inference_engine.journal.postgres import PostgresJournal  # psycopg is loaded only by a cluster daemon

    backend = PostgresJournal(url, node=node, sync=sync)
    try:
        records = backend.load(model)
    except JournalError:
        backend.close()
        raise
    return OpenedJournal(Journal(backend), records)


def _take_over_snapshot(directory: Path, model: Mapping[str, Any], backend: SqliteJournal) -> list[SessionRecord]:
    """Sessions of a shutdown snapshot left by an earlier version, written into the journal; the file is removed
    once they are. A snapshot of another model, or one that does not read, stops the start and stays in place."""
    path = directory / LEGACY_SNAPSHOT
    if not path.exists():
        return []
    try:
        body = json.loads(path.read_text())
        if body.get("model") != dict(model):
            raise JournalError(
                f"the session snapshot {path} was written for {body.get('model')}, not {dict(model)}: start with "
                "that model, or move the snapshot away to start without its sessions"
            )
        now = time.time()
        records = [
            SessionRecord(
                header=SessionHeader(
                    session_id=entry["session_id"],
                    label=entry["label"],
                    eos_token_ids=tuple(entry["eos_token_ids"]),
                    kv_strategy=entry["kv_strategy"],
                    sink=entry["sink"],
                    window=entry["window"],
                ),
                tokens=list(entry["tokens"]),
                last_active_unix=now - float(entry["idle_seconds"]),
            )
            for entry in body["sessions"]
        ]
    except JournalError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise JournalError(f"cannot read the session snapshot {path}: {exc}") from exc
    backend.write([JournalOpened(r.header, tuple(r.tokens), r.last_active_unix) for r in records])
    path.unlink()
    return records
