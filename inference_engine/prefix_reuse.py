"""A session's first generation starts from another session's K/V where their histories begin alike.

Agents of one application open their conversations with the same system prompt and tool definitions. Before a
session that holds no K/V yet prefills, the held session whose committed history shares the longest prefix with its
own (at least `MIN_SHARED_TOKENS`) lends it a copy of that prefix's K/V and drafting state, as a fork would copy
them, and only the rest is prefilled. A lender is used only while it is idle (never waited for), and only between
sessions of the `full` strategy without a KV compressor, whose K/V do not depend on how a history arrived
(docs/operator-guide.md#exact-histories).
"""

from __future__ import annotations

import logging

import numpy as np

from inference_engine.engine import EngineLoop
from inference_engine.metrics import Metrics
from inference_engine.sessions import Session, SessionStore
from kv_cache_proposer.cache.snapshot import clone_cache
from kv_cache_proposer.decoding import SequenceState
from kv_cache_proposer.sequence import shared_prefix

log = logging.getLogger(__name__)

MIN_SHARED_TOKENS = 32  # below this a copy saves less than it costs to find and make


class PrefixReuse:
    """Finds a lender for a session about to prefill its whole history, and copies the shared prefix from it."""

    def __init__(self, store: SessionStore, engine: EngineLoop, metrics: Metrics) -> None:
        self.store = store
        self.engine = engine
        self.metrics = metrics

    async def reuse(self, session: Session) -> int:
        """Give `session` (holding its turn, no K/V yet) the K/V of the longest prefix an idle session shares with
        its history, leaving at least its last token pending; returns how many positions it now holds."""
        seq = session.seq
        if seq.committed or not _lends(session):
            return 0
        lender, length = self._lender(session)
        if lender is None:
            return 0
        async with lender.lock:  # free (the lender is idle): taken without waiting, so it is not closed meanwhile
            try:
                await self.engine.call(adopt_prefix, seq, lender.seq, length)
            except (TypeError, ValueError) as exc:  # a cache that cannot be copied at that length: prefill instead
                log.debug("prefix not reused", extra={"session_id": session.session_id, "error": str(exc)})
                return 0
        self.metrics.session_prefix_reused_positions.inc(length)
        log.debug(
            "prefix reused", extra={"session_id": session.session_id, "from": lender.session_id, "tokens": length}
        )
        return length

    def _lender(self, session: Session) -> tuple[Session | None, int]:
        """The idle session sharing the longest committed prefix with `session`'s history, and that length."""
        wanted = np.asarray(session.seq.tokens[:-1], dtype=np.int64)
        best: Session | None = None
        best_length = MIN_SHARED_TOKENS - 1
        for other in self.store.sessions():
            if other is session or other.busy or other.closed or not _alike(session, other):
                continue
            held = other.seq.committed
            if held <= best_length:
                continue
            length = shared_prefix(wanted, other.seq.tokens[:held])
            if length > best_length:
                best, best_length = other, length
        return (best, best_length) if best is not None else (None, 0)


def adopt_prefix(seq: SequenceState, lender: SequenceState, length: int) -> None:
    """`seq` (no K/V yet) takes copies of `lender`'s caches at `length` committed positions. Runs on the engine
    thread."""
    cache = clone_cache(lender.cache, length)
    draft = lender.draft_session.clone(length)
    seq.cache.release()
    seq.draft_session.release()
    seq.cache, seq.draft_session, seq.committed = cache, draft, length


def _lends(session: Session) -> bool:
    return session.seq.cache.strategy.name == "full" and session.compressor.label == "none"


def _alike(session: Session, other: Session) -> bool:
    """Whether `other`'s caches can stand in for `session`'s own."""
    return (
        _lends(other)
        and type(other.seq.cache) is type(session.seq.cache)
        and type(other.seq.draft_session) is type(session.seq.draft_session)
    )
