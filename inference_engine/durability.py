"""What a runtime keeps of its sessions across restarts and daemons: the session journal.

Every change to a session (opened, tokens appended, ended) is written to the journal before it is acknowledged, and a
change the journal cannot record is not made (`JournalUnavailable`). At start-up the journaled sessions come back
under their ids with their whole history pending: the next generation reads back the K/V files a session left
(`durable_kv.DurableKV`) and prefills the rest. With a journal shared by a cluster, a session asked for here that
another daemon held is taken over (`cluster.SessionTakeovers`) and prefills its history.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from inference_engine.cluster import ClusterMetrics, SessionTakeovers
from inference_engine.config import ServerConfig
from inference_engine.durable_kv import DurableKV
from inference_engine.errors import InvalidArgument, JournalUnavailable
from inference_engine.journal import (
    Journal,
    JournalAppended,
    JournalDamaged,
    JournalEnded,
    JournalEntry,
    JournalError,
    JournalOpened,
    OwnershipLost,
    SessionHeader,
    SessionRecord,
)
from inference_engine.model_source import model_identity
from inference_engine.sessions import Session, SessionStore
from inference_engine.validation import RequestChecks
from kv_cache_proposer.compression import KVCompressor
from kv_cache_proposer.strategies import KVStrategy, make_strategy, strategy_options

log = logging.getLogger(__name__)


class SessionJournal:
    """The runtime's record of its sessions: changes journaled before they are acknowledged, sessions restored from
    the journal, and (with a shared journal) sessions taken over from other daemons."""

    def __init__(
        self,
        config: ServerConfig,
        checks: RequestChecks,
        store: SessionStore,
        vocab_size: int,
        cluster_metrics: ClusterMetrics,
        open_session: Callable[[str, str, Iterable[int], KVStrategy, list[int], float, KVCompressor], Session],
    ) -> None:
        """`open_session` adds a new session to the store, its `tokens` pending."""
        self.config = config
        self.checks = checks
        self.store = store
        self.vocab_size = vocab_size
        self.cluster_metrics = cluster_metrics
        self._open_session = open_session
        self.journal: Journal | None = None
        self.takeovers: SessionTakeovers | None = None  # set when the journal is shared by a cluster
        self.kv: DurableKV | None = None  # set when sessions' K/V are kept beside the journal (`keep_kv`)

    def identity(self) -> dict[str, Any]:
        """What a session snapshot must match to be restored into this runtime."""
        identity: dict[str, Any] = {
            "model": model_identity(self.config.model_dir),
            "backend": self.config.backend,
            "vocab_size": self.vocab_size,
        }
        if self.config.weights != "float32":  # a journal of full-precision weights reads as it always has
            identity["weights"] = self.config.weights
        return identity

    def attach(self, journal: Journal) -> None:
        """Record every session change in `journal` from now on; sessions that end are written as ended. A shared
        journal also brings the sessions this daemon does not hold when they are asked for (`acquire`)."""
        self.journal = journal
        self.store.on_detach = self._ended
        if journal.shared:
            self.takeovers = SessionTakeovers(journal, self.store, self.restore, self.cluster_metrics)

    def keep_kv(self, kv: DurableKV) -> None:
        """Keep sessions' K/V in `kv`'s files from now on; sessions restored afterwards read theirs back."""
        self.kv = kv

    def _ended(self, session: Session) -> None:
        if self.journal is not None:
            self.journal.submit(JournalEnded(session.session_id))
        if self.kv is not None:
            self.kv.forget(session.session_id)

    async def acquire(self, session_id: str, *, touch: bool = True) -> Session:
        """The session with this id: held here, or (with a shared journal) taken over from it; else `NOT_FOUND`."""
        if self.takeovers is None:
            return self.store.get(session_id, touch=touch)
        return await self.takeovers.acquire(session_id, touch=touch)

    def restore_all(self, records: list[SessionRecord], *, drop_invalid: bool = False) -> list[str]:
        """Bring journaled sessions back under their ids, with their whole history pending.

        Idle time counts from each session's last journaled activity, so the TTL applies as to any session. A
        record that does not fit this model raises `JournalDamaged`, or with `drop_invalid` is dropped (and
        written as ended); returns what was dropped.
        """
        dropped = []
        for record in records:
            try:
                self.restore(record)
            except JournalDamaged as exc:
                if not drop_invalid:
                    raise
                dropped.append(str(exc))
                if self.journal is not None:
                    self.journal.submit(JournalEnded(record.header.session_id))
        if self.kv is not None:
            live = [session.session_id for session in self.store.sessions()]
            self.kv.sweep(live)
            self.kv.restored(live)
        return dropped

    def restore(self, record: SessionRecord) -> Session:
        """Bring one journaled session back under its id with its whole history pending; `JournalDamaged` when
        the record does not fit this model."""
        header = record.header
        try:
            compressor = KVCompressor.parse(header.kv_compressor)
            strategy = make_strategy(header.kv_strategy, sink=header.sink, window=header.window)
            eos = self.checks.tokens(header.eos_token_ids, "eos_token_ids")
            tokens = self.checks.tokens(record.tokens, "tokens")
            if len(tokens) > self.config.max_history_tokens:
                raise ValueError(f"{len(tokens)} tokens is above the --max-history-tokens limit")
        except (ValueError, InvalidArgument) as exc:
            raise JournalDamaged(f"session {header.session_id!r} cannot be restored: {exc}") from None
        last_access = self.store.now() - max(0.0, time.time() - record.last_active_unix)
        return self._open_session(header.session_id, header.label, eos, strategy, tokens, last_access, compressor)

    async def opened(self, session: Session) -> None:
        """Journal a new session; if that fails the session is freed and the call fails."""
        entry = JournalOpened(session_header(session), tuple(session.seq.tokens), time.time())
        try:
            await self.write(entry)
        except JournalUnavailable:
            self.store.detach(session, "failed", "failed: not journaled")
            session.release()
            self.store.refresh_gauges()
            raise

    async def write(self, entry: JournalEntry) -> None:
        if self.journal is None:
            return
        try:
            await self.journal.write(entry)
        except OwnershipLost as exc:
            if self.takeovers is not None and isinstance(entry, JournalAppended):
                self.takeovers.drop_lost(entry.session_id)
            raise JournalUnavailable(f"{exc}: the change was not made here; retry through the proxy") from exc
        except JournalError as exc:
            message = f"the session journal cannot record the change, so it was not made: {exc}"
            raise JournalUnavailable(message) from exc

    def fail_unjournaled(self, session: Session, exc: JournalError) -> JournalUnavailable:
        """Fail a session whose generated tokens could not be journaled: its memory and journal would disagree."""
        if isinstance(exc, OwnershipLost) and self.takeovers is not None:
            self.takeovers.drop_lost(session.session_id)
            return JournalUnavailable(f"{exc}: the generation stopped here; retry through the proxy")
        self.store.detach(session, "failed", f"failed: {exc}")
        session.release()
        self.store.refresh_gauges()
        log.error("session failed: tokens not journaled", extra={"session_id": session.session_id, "error": str(exc)})
        return JournalUnavailable(f"session {session.session_id!r} failed and was freed: {exc}")


def session_header(session: Session) -> SessionHeader:
    """What the journal records about a session besides its tokens."""
    strategy = session.seq.cache.strategy
    options = strategy_options(strategy)
    return SessionHeader(
        session_id=session.session_id,
        label=session.label,
        eos_token_ids=tuple(sorted(session.eos_token_ids)),
        kv_strategy=strategy.name,
        sink=options.get("sink", 0),
        window=options.get("window", 0),
        kv_compressor=session.compressor.label,
    )
