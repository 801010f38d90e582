"""The journal on a PostgreSQL server (`--journal-url postgresql://...`), shared by the daemons of a cluster.

Tables (created on first use, under an advisory lock so daemons starting together do not race): `kakeya_meta`
(format and model identity), `kakeya_sessions` (one row per live session: its header, the time of its last
journaled activity, and its ownership record) and `kakeya_chunks` (the history, one row per write, in order).

Ownership: `owner` names the daemon serving the session and `epoch` is a fencing token. A daemon that receives a call
for a session it does not hold takes it over in one statement (`epoch = epoch + 1`, owner = itself) and reads the
history in the same transaction. Every later write of a daemon is conditional on the epoch it took: a history chunk
is inserted only while the session row still carries that epoch, so once another daemon has taken the session over,
the stale owner's writes are refused (it loses the session) and two daemons never append to one history.

Durability (`sync`): every write is one transaction, committed before the call it belongs to is acknowledged.
`normal` commits with `synchronous_commit = off`: a committed transaction is on the database server, so it survives
the daemon being killed; a crash of the database server itself can lose the last fraction of a second of commits.
`full` commits with `synchronous_commit = on`: the server flushes its write-ahead log before the commit returns.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg

from inference_engine.journal.entries import (
    JournalAppended,
    JournalDamaged,
    JournalEntry,
    JournalError,
    JournalOpened,
    SessionHeader,
    SessionRecord,
)
from inference_engine.journal.sqlite import pack_tokens, unpack_tokens

log = logging.getLogger(__name__)

FORMAT = 1
URL_SCHEMES = ("postgresql://", "postgres://")
_SCHEMA_LOCK = 0x6B616B65  # advisory lock key held while the schema is created
_SYNC = {"normal": "off", "full": "on"}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS kakeya_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS kakeya_sessions (
    session_id TEXT PRIMARY KEY,
    label TEXT NOT NULL,
    eos_token_ids TEXT NOT NULL,
    kv_strategy TEXT NOT NULL,
    sink_tokens INTEGER NOT NULL,
    window_tokens INTEGER NOT NULL,
    kv_compressor TEXT NOT NULL,
    last_active_unix DOUBLE PRECISION NOT NULL,
    owner TEXT NOT NULL,
    epoch BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS kakeya_chunks (
    id BIGSERIAL PRIMARY KEY,
    session_id TEXT NOT NULL,
    tokens BYTEA NOT NULL
);
CREATE INDEX IF NOT EXISTS kakeya_chunks_by_session ON kakeya_chunks (session_id, id);
"""

_HEADER_COLUMNS = "session_id, label, eos_token_ids, kv_strategy, sink_tokens, window_tokens, kv_compressor"


def is_postgres_url(url: str) -> bool:
    return url.startswith(URL_SCHEMES)


def redact_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not at:
        return url
    user = credentials.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{host}" if ":" in credentials else url


class PostgresJournal:
    """The shared journal on a PostgreSQL server, written by the daemon named `node`.

    Holds one connection, used by one thread at a time (the journal's writer thread once it runs), and the epoch it
    holds for every session it serves.
    """

    shared = True

    def __init__(self, url: str, *, node: str, sync: str = "normal", connect_timeout_s: float = 10.0) -> None:
        if sync not in _SYNC:
            raise ValueError(f"sync must be one of {', '.join(_SYNC)}, got {sync!r}")
        if not is_postgres_url(url):
            raise JournalError(f"the journal URL must start with postgresql://, got {redact_url(url)!r}")
        self.url = url
        self.node = node
        self._sync = sync
        self._connect_timeout_s = max(1, int(connect_timeout_s))
        self._held: dict[str, int] = {}  # session id -> epoch this daemon took
        try:
            self._db = self._connect()
        except psycopg.Error as exc:
            raise JournalError(f"cannot connect to the session journal {self.location}: {exc}") from exc

    @property
    def location(self) -> str:
        return redact_url(self.url)

    # -- JournalBackend ----------------------------------------------------------------------------------------
    def load(self, model: Mapping[str, Any]) -> list[SessionRecord]:
        """Create the tables if needed and check the model. Returns no sessions: in a cluster a session comes to
        the daemon its calls reach, on the first of them (`take_over`)."""
        identity = json.dumps(dict(model), sort_keys=True)
        try:
            with self._db.transaction():
                self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                self._db.execute(_SCHEMA)
                meta = dict(self._db.execute("SELECT key, value FROM kakeya_meta").fetchall())
                if meta and meta.get("format") != str(FORMAT):
                    raise JournalError(
                        f"{self.location} has journal format {meta.get('format')!r}; this server reads {FORMAT}"
                    )
                written_for = meta.get("model")
                if written_for is not None and written_for != identity:
                    live = self._fetch_one("SELECT count(*) FROM kakeya_sessions")
                    if live is not None and live[0]:
                        raise JournalError(
                            f"the session journal {self.location} holds sessions of {written_for}, not {identity}: "
                            "every daemon sharing a journal must serve the same model"
                        )
                self._db.execute(
                    "INSERT INTO kakeya_meta (key, value) VALUES ('format', %s), ('model', %s) "
                    "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                    (str(FORMAT), identity),
                )
        except psycopg.Error as exc:
            raise JournalError(f"cannot prepare the session journal {self.location}: {exc}") from exc
        return []

    def write(self, entries: Sequence[JournalEntry]) -> frozenset[str]:
        if not entries:
            return frozenset()
        refused: set[str] = set()
        try:
            with self._db.transaction():
                for entry in entries:
                    if not self._apply(entry):
                        refused.add(_session_of(entry))
        except psycopg.Error as exc:
            self._recover_connection()
            raise JournalError(f"cannot write the session journal {self.location}: {exc}") from exc
        return frozenset(refused)

    def take_over(self, session_id: str) -> SessionRecord | None:
        """Make this daemon the session's owner (a new epoch) and read its history, atomically; None when the
        journal holds no such session."""
        try:
            with self._db.transaction():
                row = self._db.execute(
                    f"UPDATE kakeya_sessions SET owner = %s, epoch = epoch + 1 WHERE session_id = %s "
                    f"RETURNING {_HEADER_COLUMNS}, last_active_unix, epoch",
                    (self.node, session_id),
                ).fetchone()
                if row is None:
                    return None
                tokens: list[int] = []
                for (blob,) in self._db.execute(
                    "SELECT tokens FROM kakeya_chunks WHERE session_id = %s ORDER BY id", (session_id,)
                ):
                    tokens.extend(unpack_tokens(bytes(blob)))
        except psycopg.Error as exc:
            self._recover_connection()
            raise JournalError(f"cannot read session {session_id!r} from {self.location}: {exc}") from exc
        *header, last_active, epoch = row
        self._held[session_id] = int(epoch)
        return SessionRecord(header=_header(header), tokens=tokens, last_active_unix=float(last_active))

    def owner(self, session_id: str) -> tuple[str, int] | None:
        """(owner, epoch) of a session as the journal holds it now; None when it holds no such session."""
        row = self._fetch_one("SELECT owner, epoch FROM kakeya_sessions WHERE session_id = %s", (session_id,))
        self._db.commit()
        return None if row is None else (str(row[0]), int(row[1]))

    def close(self) -> None:
        self._db.close()

    # -- internals ---------------------------------------------------------------------------------------------
    def _apply(self, entry: JournalEntry) -> bool:
        """Apply one entry inside the current transaction; False when it was refused (ownership lost)."""
        db = self._db
        if isinstance(entry, JournalAppended):
            epoch = self._held.get(entry.session_id)
            if epoch is None:
                return False
            # One statement: the chunk is inserted only while the row still carries this daemon's epoch (the
            # UPDATE locks the row, so a concurrent take-over either commits first and refuses this, or waits).
            cursor = db.execute(
                "WITH owned AS (UPDATE kakeya_sessions SET last_active_unix = %s "
                "WHERE session_id = %s AND epoch = %s RETURNING session_id) "
                "INSERT INTO kakeya_chunks (session_id, tokens) SELECT session_id, %s FROM owned",
                (entry.at_unix, entry.session_id, epoch, pack_tokens(entry.tokens)),
            )
            return self._kept(entry.session_id, cursor.rowcount == 1)
        if isinstance(entry, JournalOpened):
            header = entry.header
            row = db.execute(
                f"INSERT INTO kakeya_sessions ({_HEADER_COLUMNS}, last_active_unix, owner, epoch) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, 1) "
                "ON CONFLICT (session_id) DO UPDATE SET owner = EXCLUDED.owner, epoch = kakeya_sessions.epoch + 1, "
                "last_active_unix = EXCLUDED.last_active_unix RETURNING epoch",
                (
                    header.session_id,
                    header.label,
                    json.dumps(list(header.eos_token_ids)),
                    header.kv_strategy,
                    header.sink,
                    header.window,
                    header.kv_compressor,
                    entry.at_unix,
                    self.node,
                ),
            ).fetchone()
            assert row is not None  # INSERT ... RETURNING always returns the row
            self._held[header.session_id] = int(row[0])
            db.execute("DELETE FROM kakeya_chunks WHERE session_id = %s", (header.session_id,))
            if entry.tokens:
                db.execute(
                    "INSERT INTO kakeya_chunks (session_id, tokens) VALUES (%s, %s)",
                    (header.session_id, pack_tokens(entry.tokens)),
                )
            return True
        epoch = self._held.pop(entry.session_id, None)
        if epoch is None:
            return False
        gone = db.execute(
            "DELETE FROM kakeya_sessions WHERE session_id = %s AND epoch = %s RETURNING session_id",
            (entry.session_id, epoch),
        ).fetchone()
        if gone is None:
            return False
        db.execute("DELETE FROM kakeya_chunks WHERE session_id = %s", (entry.session_id,))
        return True

    def _kept(self, session_id: str, kept: bool) -> bool:
        if not kept:
            self._held.pop(session_id, None)
        return kept

    def _fetch_one(self, query: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        return self._db.execute(query, params).fetchone()

    def _connect(self) -> psycopg.Connection[Any]:
        db = psycopg.connect(self.url, connect_timeout=self._connect_timeout_s)
        db.execute(f"SET synchronous_commit = {_SYNC[self._sync]}")
        db.commit()
        return db

    def _recover_connection(self) -> None:
        """After a failed transaction, reconnect if the connection itself broke, so the next write can succeed."""
        if not self._db.closed and self._db.info.transaction_status != psycopg.pq.TransactionStatus.UNKNOWN:
            return
        try:
            self._db = self._connect()
        except psycopg.Error as exc:
            log.error("cannot reconnect to the session journal %s: %s", self.location, exc)


def _session_of(entry: JournalEntry) -> str:
    return entry.header.session_id if isinstance(entry, JournalOpened) else entry.session_id


def _header(row: Sequence[Any]) -> SessionHeader:
    session_id, label, eos, strategy, sink, window, compressor = row
    try:
        eos_ids = tuple(int(t) for t in json.loads(eos))
    except (ValueError, TypeError) as exc:
        raise JournalDamaged(f"session {session_id!r} has unreadable end-of-sequence ids: {exc}") from None
    return SessionHeader(
        session_id=str(session_id),
        label=str(label),
        eos_token_ids=eos_ids,
        kv_strategy=str(strategy),
        sink=int(sink),
        window=int(window),
        kv_compressor=str(compressor),
    )
