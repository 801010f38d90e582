"""The journal on SQLite (standard library `sqlite3`), in WAL mode, inside the state directory.

Tables: `meta` (format and model identity), `sessions` (one row per live session: its header and the time of its
last journaled activity) and `chunks` (the history, one row per write, in order). An ended session's rows are
deleted, so the file holds only live sessions; a start compacts each history into one row.

Durability (`sync`): every write is one transaction, committed before the call it belongs to is acknowledged.
`normal` (PRAGMA synchronous=NORMAL): a committed transaction is in the write-ahead log in the operating system's
file cache, so it survives the process being killed (SIGKILL, OOM); an operating-system crash or power cut can lose
the transactions since the last checkpoint. `full` (synchronous=FULL): the log is fsynced at every commit, so a
committed transaction also survives a power cut.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import sys
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from inference_engine.journal.entries import (
    JournalAppended,
    JournalDamaged,
    JournalEnded,
    JournalEntry,
    JournalError,
    JournalOpened,
    SessionHeader,
    SessionRecord,
)

log = logging.getLogger(__name__)

FILE_NAME = "journal.sqlite3"
FORMAT = 1
SYNC_POLICIES = ("normal", "full")
_SIDE_FILES = ("-wal", "-shm")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    label TEXT NOT NULL,
    eos_token_ids TEXT NOT NULL,
    kv_strategy TEXT NOT NULL,
    sink INTEGER NOT NULL,
    window INTEGER NOT NULL,
    kv_compressor TEXT NOT NULL,
    last_active_unix REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS chunks (id INTEGER PRIMARY KEY, session_id TEXT NOT NULL, tokens BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS chunks_by_session ON chunks (session_id, id);
"""


def prepare_state_dir(directory: Path) -> None:
    """Create the state directory owner-only (0700), or make an existing one so: the journal holds full histories."""
    if directory.exists() and not directory.is_dir():
        raise JournalError(f"the state directory {directory} is not a directory")
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
    except OSError as exc:
        raise JournalError(f"cannot create the state directory {directory}: {exc}") from exc


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32."""
    packed = array("I", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(blob: bytes) -> list[int]:
    if len(blob) % 4:
        raise JournalDamaged(f"a history chunk of {len(blob)} bytes is not a whole number of uint32 token ids")
    packed = array("I")
    packed.frombytes(blob)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


class SqliteJournal:
    """The journal in `directory/journal.sqlite3`; the file and its WAL side files are owner-only (0600)."""

    def __init__(self, directory: Path, *, sync: str = "normal") -> None:
        if sync not in SYNC_POLICIES:
            raise ValueError(f"sync must be one of {', '.join(SYNC_POLICIES)}, got {sync!r}")
        self.path = directory / FILE_NAME
        prepare_state_dir(directory)
        try:
            # SQLite gives the -wal and -shm files the mode of the database file, so creating it 0600 covers them.
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            for path in (self.path, *(self.path.with_name(self.path.name + s) for s in _SIDE_FILES)):
                if path.exists():
                    os.chmod(path, 0o600)
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except (OSError, sqlite3.Error) as exc:
            raise JournalError(f"cannot open the session journal {self.path}: {exc}") from exc
        try:
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode != "wal":
                raise JournalError(f"the session journal {self.path} cannot use WAL mode (got {mode!r})")
            self._db.execute(f"PRAGMA synchronous={sync.upper()}")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise JournalDamaged(f"the session journal {self.path} is damaged: {exc}") from exc

    @property
    def location(self) -> str:
        return str(self.path)

    # -- JournalBackend ----------------------------------------------------------------------------------------
    def load(self, model: Mapping[str, Any]) -> list[SessionRecord]:
        try:
            check = self._db.execute("PRAGMA quick_check").fetchall()
            if check != [("ok",)]:
                raise JournalDamaged(f"the session journal {self.path} is damaged: {check[0][0]}")
            meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
            records = self._read_sessions()
        except sqlite3.DatabaseError as exc:
            raise JournalDamaged(f"the session journal {self.path} is damaged: {exc}") from exc
        if meta and meta.get("format") != str(FORMAT):
            raise JournalError(f"{self.path} has journal format {meta.get('format')!r}; this server reads {FORMAT}")
        written_for = json.loads(meta["model"]) if "model" in meta else None
        if written_for is not None and written_for != dict(model) and records:
            raise JournalError(
                f"the session journal {self.path} was written for {written_for}, not {dict(model)}: start with that "
                "model, or move the journal away to start without its sessions"
            )
        self._transaction(self._stamp, model)
        self._transaction(self._compact, records)
        return records

    def write(self, entries: Sequence[JournalEntry]) -> frozenset[str]:
        if entries:
            self._transaction(self._apply, entries)
        return frozenset()

    def close(self) -> None:
        self._db.close()

    # -- salvage -----------------------------------------------------------------------------------------------
    @staticmethod
    def salvage(directory: Path) -> tuple[list[SessionRecord], list[str], Path]:
        """Move a damaged journal aside and read what still can be read from it.

        Returns (the sessions read back, a description of what was dropped, where the damaged file now is).
        """
        path = directory / FILE_NAME
        aside = path.with_name(f"{FILE_NAME}.damaged-{os.getpid()}-{int.from_bytes(os.urandom(3), 'big'):06x}")
        os.replace(path, aside)
        for suffix in _SIDE_FILES:
            side = path.with_name(path.name + suffix)
            if side.exists():
                os.replace(side, aside.with_name(aside.name + suffix))
        records: list[SessionRecord] = []
        dropped: list[str] = []
        try:
            db = sqlite3.connect(f"file:{aside}?mode=ro", uri=True)
            ids = [row[0] for row in db.execute("SELECT session_id FROM sessions")]
        except sqlite3.DatabaseError as exc:
            return [], [f"every session: the file cannot be read ({exc})"], aside
        for session_id in ids:
            try:
                records.extend(_read_sessions(db, session_id))
            except (sqlite3.DatabaseError, JournalDamaged, ValueError) as exc:
                dropped.append(f"session {session_id!r}: {exc}")
        db.close()
        records.sort(key=lambda r: r.last_active_unix)
        return records, dropped, aside

    # -- internals ---------------------------------------------------------------------------------------------
    def _read_sessions(self) -> list[SessionRecord]:
        return _read_sessions(self._db, None)

    def _transaction(self, body: Any, argument: Any) -> None:
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                body(db, argument)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            raise JournalError(f"cannot write the session journal {self.path}: {exc}") from exc

    @staticmethod
    def _stamp(db: sqlite3.Connection, model: Mapping[str, Any]) -> None:
        db.executemany(
            "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
            [("format", str(FORMAT)), ("model", json.dumps(dict(model), sort_keys=True))],
        )

    @staticmethod
    def _compact(db: sqlite3.Connection, records: list[SessionRecord]) -> None:
        for record in records:
            session_id = record.header.session_id
            (count,) = db.execute("SELECT count(*) FROM chunks WHERE session_id = ?", (session_id,)).fetchone()
            if count > 1:
                db.execute("DELETE FROM chunks WHERE session_id = ?", (session_id,))
                db.execute(
                    "INSERT INTO chunks (session_id, tokens) VALUES (?, ?)", (session_id, pack_tokens(record.tokens))
                )

    @staticmethod
    def _apply(db: sqlite3.Connection, entries: Sequence[JournalEntry]) -> None:
        for entry in entries:
            if isinstance(entry, JournalAppended):
                db.execute(
                    "INSERT INTO chunks (session_id, tokens) VALUES (?, ?)",
                    (entry.session_id, pack_tokens(entry.tokens)),
                )
                db.execute(
                    "UPDATE sessions SET last_active_unix = ? WHERE session_id = ?", (entry.at_unix, entry.session_id)
                )
            elif isinstance(entry, JournalOpened):
                header = entry.header
                db.execute(
                    "INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        header.session_id,
                        header.label,
                        json.dumps(list(header.eos_token_ids)),
                        header.kv_strategy,
                        header.sink,
                        header.window,
                        header.kv_compressor,
                        entry.at_unix,
                    ),
                )
                db.execute("DELETE FROM chunks WHERE session_id = ?", (header.session_id,))
                if entry.tokens:
                    db.execute(
                        "INSERT INTO chunks (session_id, tokens) VALUES (?, ?)",
                        (header.session_id, pack_tokens(entry.tokens)),
                    )
            elif isinstance(entry, JournalEnded):
                db.execute("DELETE FROM chunks WHERE session_id = ?", (entry.session_id,))
                db.execute("DELETE FROM sessions WHERE session_id = ?", (entry.session_id,))


def _read_sessions(db: sqlite3.Connection, only: str | None) -> list[SessionRecord]:
    """Sessions with their histories, least recently active first (all of them, or the one with id `only`)."""
    query = "SELECT * FROM sessions" + (" WHERE session_id = ?" if only is not None else "")
    rows = db.execute(query + " ORDER BY last_active_unix", (only,) if only is not None else ()).fetchall()
    records = []
    for session_id, label, eos, strategy, sink, window, compressor, last_active in rows:
        try:
            eos_ids = tuple(int(t) for t in json.loads(eos))
        except (ValueError, TypeError) as exc:
            raise JournalDamaged(f"session {session_id!r} has unreadable end-of-sequence ids: {exc}") from None
        tokens: list[int] = []
        for (blob,) in db.execute("SELECT tokens FROM chunks WHERE session_id = ? ORDER BY id", (session_id,)):
            tokens.extend(unpack_tokens(bytes(blob)))
        header = SessionHeader(
            session_id=str(session_id),
            label=str(label),
            eos_token_ids=eos_ids,
            kv_strategy=str(strategy),
            sink=int(sink),
            window=int(window),
            kv_compressor=str(compressor),
        )
        records.append(SessionRecord(header=header, tokens=tokens, last_active_unix=float(last_active)))
    return records
