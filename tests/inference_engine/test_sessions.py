"""SessionStore policy with a controllable clock."""

from __future__ import annotations

import asyncio

import pytest
import torch

from inference_engine.describe import describe_session
from inference_engine.errors import InvalidArgument, ResourceExhausted, SessionNotFound
from inference_engine.metrics import Metrics
from inference_engine.sessions import Session, SessionStore
from kv_cache_proposer.compression import KVCompressor, compressor_layer_store
from kv_cache_proposer.decoding import SequenceState
from kv_cache_proposer.strategies import FullStrategy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _store(**kwargs) -> tuple[SessionStore, Clock]:
    clock = Clock()
    settings = {"max_sessions": 3, "idle_ttl_s": 10.0, "kv_budget_bytes": 1000, **kwargs}
    return SessionStore(metrics=Metrics(), clock=clock, **settings), clock


@pytest.fixture
def verifier(verifiers):
    return verifiers["qwen3"]


def _session(store: SessionStore, verifier=None, tokens: int = 0) -> Session:
    """A session whose real cache holds the K/V of `tokens` positions (no verifier: an empty cache)."""
    cache = (verifier or _EMPTY).new_cache(FullStrategy())
    if tokens:
        verifier.verify(cache, list(range(1, tokens + 1)), 1)
        verifier.commit(cache, tokens)
    session = Session(store.new_id(), "", frozenset(), SequenceState(cache=cache), store.now())
    store.add(session)
    return session


class _EmptyCaches:
    def new_cache(self, strategy):
        from kv_cache_proposer.backends.torch_backend.arrays import TorchArrayOps
        from kv_cache_proposer.cache import KVSessionCache

        return KVSessionCache(strategy, num_layers=1, ops=TorchArrayOps(torch.device("cpu")))


_EMPTY = _EmptyCaches()


def test_ids_are_unique_and_unguessable():
    ids = {SessionStore.new_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) >= 32 for i in ids)


def test_lookup_of_unknown_or_empty_ids_fails_typed():
    store, _ = _store()
    with pytest.raises(InvalidArgument):
        store.get("")
    with pytest.raises(SessionNotFound):
        store.get("missing")


def test_ttl_eviction_spares_recent_and_busy_sessions():
    store, clock = _store()
    old, busy = _session(store), _session(store)
    clock.now = 5.0
    fresh = _session(store)
    busy.queued = 1
    clock.now = 12.0
    assert store.evict_idle() == 1
    assert {s.session_id for s in store.sessions()} == {busy.session_id, fresh.session_id}
    with pytest.raises(SessionNotFound, match="evicted: ttl"):
        store.get(old.session_id)


def test_a_full_store_evicts_the_least_recently_used_idle_session():
    store, clock = _store(max_sessions=2)
    a, b = _session(store), _session(store)
    clock.now = 1.0
    store.get(a.session_id)
    _session(store)
    assert a in store.sessions() and b not in store.sessions()


def test_a_full_store_of_busy_sessions_refuses_new_ones():
    store, _ = _store(max_sessions=1)
    _session(store).queued = 1
    with pytest.raises(ResourceExhausted):
        _session(store)


def test_the_budget_evicts_memory_holders_least_recent_first_and_spares_the_protected(verifier):
    store, _ = _store(kv_budget_bytes=10**9, max_sessions=10)
    a, empty, b = _session(store, verifier, 10), _session(store), _session(store, verifier, 10)
    grower = _session(store, verifier, 10)
    one = a.kv_bytes
    store.kv_budget_bytes = 3 * one
    assert store.enforce_budget(protect=grower)
    verifier.verify(grower.seq.cache, [t % 100 for t in range(300)], 1)
    verifier.commit(grower.seq.cache, 300)  # the protected session grows past one session's worth
    store.kv_budget_bytes = grower.kv_bytes + one  # room for one of the two idle holders
    assert store.enforce_budget(protect=grower)
    assert a not in store.sessions() and empty in store.sessions() and b in store.sessions()
    assert a.kv_bytes == 0, "an evicted session's memory is freed"
    store.kv_budget_bytes = one
    assert not store.enforce_budget(protect=grower)
    assert store.sessions() == [empty, grower]


def test_the_budget_charges_a_generating_session_its_last_forwards_high_and_its_peak_outlives_the_generation(verifier):
    store, _ = _store(kv_budget_bytes=10**9, max_sessions=10)
    factory = compressor_layer_store("torch", KVCompressor("kakeya_d4", 38))
    cache = verifier.new_cache(FullStrategy(), layer_store=factory)
    verifier.verify(cache, list(range(1, 41)), 1)
    verifier.commit(cache, 40)
    session = Session(store.new_id(), "", frozenset(), SequenceState(cache=cache), store.now())
    store.add(session)
    other = _session(store, verifier, 40)
    held = cache.footprint()
    assert held.working_bytes > 0  # the unpacked residents and the stage, held while it generates
    # While it generates it is charged what it holds or, if more, what it held as its forward ended (the block
    # staged, not yet coded by the commit; its next forward holds about as much), and that is its peak.
    assert held.forward_bytes > 0 and held.nbytes == session.kv_bytes
    generating = max(held.nbytes, held.forward_bytes)
    store.kv_budget_bytes = generating + other.kv_bytes
    assert store.enforce_budget(protect=session) and len(store) == 2
    assert session.kv_peak_bytes == generating
    store.kv_budget_bytes -= 1  # the generating session's working storage counts: the idle one must go
    assert store.enforce_budget(protect=session) and store.sessions() == [session]
    cache.park()
    store.charge(session)
    assert cache.footprint().working_bytes == 0 and cache.footprint().forward_bytes == 0
    assert session.kv_bytes < held.nbytes
    assert store.enforce_budget(protect=None)  # parked, it is charged what it holds
    store.kv_budget_bytes = session.kv_bytes
    assert store.enforce_budget(protect=session) and store.sessions() == [session]
    info = describe_session(session, 0, idle_seconds=0.0)
    assert info.kv_live_bytes == session.kv_bytes and info.kv_peak_bytes == generating


def test_session_lock_marks_it_busy():
    store, _ = _store()
    session = _session(store)

    async def hold() -> bool:
        async with session.lock:
            return session.busy

    assert asyncio.run(hold()) and not session.busy
