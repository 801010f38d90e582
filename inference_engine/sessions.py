"""Sessions and the store that owns them: ids, lookup, lifecycle and eviction (TTL, LRU, KV byte budget)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from inference_engine.errors import InvalidArgument, ResourceExhausted, SessionFailed, SessionNotFound
from inference_engine.metrics import Metrics
from kv_cache_proposer.compression import KVCompressor
from kv_cache_proposer.decoding import SequenceState
from kv_cache_proposer.errors import InvariantViolation

log = logging.getLogger(__name__)

_TOMBSTONES = 4096


@dataclass(eq=False)
class Session:
    """One client conversation: its history bound to a verifier cache, and the state of its requests (turns,
    generation, cancellation)."""

    session_id: str
    label: str
    eos_token_ids: frozenset[int]
    seq: SequenceState
    last_access: float
    compressor: KVCompressor = field(default_factory=KVCompressor)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    queued: int = 0
    generating: bool = False
    finishing: bool = False  # its generation sent Done and has not parked the session yet
    cancel: asyncio.Event | None = None
    closed: bool = False
    invariant_violations: dict[str, int] = field(default_factory=lambda: {"inv1": 0, "inv2": 0})
    single_shot: bool = False  # an HTTP shim request's session, which ends with its request
    kv_peak_bytes: int = 0  # the most it was charged (`SessionStore`): after each step, its forward's high included

    @property
    def busy(self) -> bool:
        """Whether a request holds or waits for the session; busy sessions are never evicted."""
        return self.queued > 0 or self.lock.locked()

    @property
    def kv_bytes(self) -> int:
        """Bytes of K/V the session holds: the verifier cache and any drafter state."""
        return self.seq.cache.footprint().nbytes + self.draft_bytes

    @property
    def draft_bytes(self) -> int:
        """Bytes the session's proposer holds (a drafter's K/V, an n-gram index)."""
        return int(self.seq.draft_session.nbytes)

    def release(self) -> None:
        """Free the session's cache and drafting state."""
        self.seq.cache.release()
        self.seq.draft_session.release()

    def fork(self, session_id: str, seq: SequenceState, last_access: float, label: str | None = None) -> Session:
        """A session over `seq` (forked from this one's) that keeps this one's end-of-sequence ids, compressor and,
        unless `label` is given, label."""
        return Session(
            session_id=session_id,
            label=self.label if label is None else label,
            eos_token_ids=self.eos_token_ids,
            seq=seq,
            last_access=last_access,
            compressor=self.compressor,
        )


class SessionStore:
    """All live sessions, keyed by server-issued ids. Runs on the event loop thread only."""

    def __init__(
        self,
        *,
        max_sessions: int,
        idle_ttl_s: float,
        kv_budget_bytes: int,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self.kv_budget_bytes = kv_budget_bytes
        self._metrics = metrics
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._charged: dict[str, int] = {}  # each session's `kv_bytes` as of its last change (`charge`)
        self._ended: OrderedDict[str, str] = OrderedDict()  # id -> why it ended, for NOT_FOUND messages
        self.on_detach: Callable[[Session], object] | None = None  # told of every session that ends
        self._gauges_at = -float("inf")  # when the gauges were last refreshed

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[Session]:
        """A snapshot of the live sessions, least recently used first."""
        return list(self._sessions.values())

    @staticmethod
    def new_id() -> str:
        """An unguessable id: 192 random bits."""
        return secrets.token_urlsafe(24)

    def now(self) -> float:
        return self._clock()

    def add(self, session: Session) -> None:
        """Admit a session, evicting the least recently used idle one when the store is full."""
        while len(self._sessions) >= self.max_sessions:
            victim = self._least_recent_idle()
            if victim is None:
                raise ResourceExhausted(f"all {self.max_sessions} sessions are busy; close one or raise --max-sessions")
            self.evict(victim, "lru")
        self.enforce_budget(protect=None)
        self._sessions[session.session_id] = session
        self._charged[session.session_id] = self._held_now(session)
        self._metrics.session_opened.inc()
        self.refresh_gauges()

    def get(self, session_id: str, *, touch: bool = True) -> Session:
        """Look a session up; `NOT_FOUND` if it is unknown, closed or evicted."""
        if not session_id:
            raise InvalidArgument("session_id is empty")
        session = self._sessions.get(session_id)
        if session is None:
            why = self._ended.get(session_id)
            suffix = f" ({why})" if why else ""
            raise SessionNotFound(f"session {session_id!r} not found{suffix}")
        if touch:
            self.touch(session)
        return session

    def touch(self, session: Session) -> None:
        session.last_access = self._clock()
        if session.session_id in self._sessions:
            self._sessions.move_to_end(session.session_id)

    def detach(self, session: Session, outcome: str, why: str) -> None:
        """Remove a session from the store (its id answers NOT_FOUND from now on). The caller frees its memory."""
        if self._sessions.pop(session.session_id, None) is None:
            return
        self._charged.pop(session.session_id, None)
        session.closed = True
        self._ended[session.session_id] = why
        while len(self._ended) > _TOMBSTONES:
            self._ended.popitem(last=False)
        self._metrics.session_total.labels(outcome=outcome).inc()
        self.refresh_gauges()
        if self.on_detach is not None:
            self.on_detach(session)

    def fail(self, session: Session, exc: InvariantViolation) -> SessionFailed:
        """Fail a session whose cache broke an invariant: count it, free it, and return the error to raise."""
        session.invariant_violations[exc.kind] += 1
        self._metrics.cache_invariant_violations.labels(kind=exc.kind).inc()
        self.detach(session, "failed", f"failed: {exc}")
        session.release()
        self.refresh_gauges()
        log.error("session failed", extra={"session_id": session.session_id, "violation": str(exc)})
        return SessionFailed(f"session {session.session_id!r} failed and was freed: cache invariant {exc}")

    def evict(self, session: Session, reason: str) -> None:
        """Evict an idle session and free its memory."""
        self.detach(session, "evicted", f"evicted: {reason}")
        session.release()
        self._metrics.session_evicted.labels(reason=reason).inc()
        self.refresh_gauges()
        log.info("session evicted", extra={"session_id": session.session_id, "reason": reason})

    def evict_idle(self) -> int:
        """Evict every idle session whose last access is older than the TTL; returns how many."""
        cutoff = self._clock() - self.idle_ttl_s
        expired = [s for s in self._sessions.values() if s.last_access < cutoff and not s.busy]
        for session in expired:
            self.evict(session, "ttl")
        return len(expired)

    def enforce_budget(self, protect: Session | None) -> bool:
        """Evict idle sessions, least recently used first, until the KV bytes fit the budget.

        Returns whether the store is within budget afterwards. Sessions count their `Session.kv_bytes`: everything
        they hold, a generating session's working storage too, so the budget holds while sessions generate. With
        `protect` (the session that just stepped) only that one is charged again, the others as of their last step
        or park (`charge`), so a step costs one session's accounting, not every session's; without it, all are.
        """
        if protect is None:
            self._charged = {key: self._held_now(session) for key, session in self._sessions.items()}
        else:
            self.charge(protect)
        total = sum(self._charged.values())
        while total > self.kv_budget_bytes:
            victim = self._least_recent_idle(exclude=protect, holding_memory=True)
            if victim is None:
                return False
            total -= self._charged.get(victim.session_id, 0)
            self.evict(victim, "budget")
        return True

    def charge(self, session: Session) -> None:
        """Record what `session` is charged against the budget now (after a step, or when it parks)."""
        if session.session_id in self._charged:
            self._charged[session.session_id] = self._held_now(session)

    @staticmethod
    def _held_now(session: Session) -> int:
        """What `session` is charged now, noted in its peak: all it holds (`Session.kv_bytes`) or, while it
        generates, what it held as its last forward ended if that is more (the whole stage beside everything else:
        a compressed session's prefill chunk, dense until the commit codes it), which its next forward holds
        about as much of."""
        footprint = session.seq.cache.footprint()
        held = max(footprint.nbytes, footprint.forward_bytes) + session.draft_bytes
        session.kv_peak_bytes = max(session.kv_peak_bytes, held)
        return held

    def kv_live_bytes(self) -> int:
        return sum(s.kv_bytes for s in self._sessions.values())

    def refresh_gauges_every(self, interval_s: float) -> None:
        """`refresh_gauges` unless it ran in the last `interval_s` seconds: a generation step calls this, so the
        gauges (which read every session) cost nothing per token while still following a long generation."""
        if self._clock() - self._gauges_at >= interval_s:
            self.refresh_gauges()

    def refresh_gauges(self) -> None:
        self._gauges_at = self._clock()
        self._metrics.session_active.set(len(self._sessions))
        self._metrics.session_kv_live_bytes.set(self.kv_live_bytes())
        self._metrics.draft_state_bytes.set(sum(s.draft_bytes for s in self._sessions.values()))
        held = [session.seq.cache.footprint() for session in self._sessions.values()]
        compressed = sum(f.compressed_bytes for f in held)
        dense = sum(f.dense_equivalent_bytes for f in held if f.compressed_bytes)
        self._metrics.kv_compressed_bytes.set(compressed)
        self._metrics.kv_dense_equivalent_bytes.set(sum(f.dense_equivalent_bytes for f in held))
        self._metrics.kv_escaped_blocks.set(sum(f.escaped_vectors for f in held))
        self._metrics.kv_compression_ratio.set(dense / compressed if compressed else 1.0)
        restored = sum(f.restored_bytes for f in held)
        state = sum(f.restoration_state_bytes for f in held)
        token_ids = sum(f.history_token_bytes for f in held)
        self._metrics.kv_restored_bytes.set(restored)
        self._metrics.kv_restored_peak_bytes.set(max((f.peak_restored_bytes for f in held), default=0))
        self._metrics.kv_session_peak_bytes.set(max((s.kv_peak_bytes for s in self._sessions.values()), default=0))
        self._metrics.kv_restoration_state_bytes.set(state)
        self._metrics.history_token_bytes.set(token_ids)
        self._metrics.kv_resident_bytes.set(sum(f.nbytes for f in held) - restored - state - token_ids)

    def _least_recent_idle(self, exclude: Session | None = None, holding_memory: bool = False) -> Session | None:
        for session in self._sessions.values():
            if session.busy or session is exclude or (holding_memory and session.kv_bytes == 0):
                continue
            return session
        return None
