"""The shared PostgreSQL journal against a real server: round trips, take-over, fencing of a stale owner, the
model check."""

from __future__ import annotations

import asyncio
import time

import pytest

from inference_engine.journal import (
    Journal,
    JournalAppended,
    JournalEnded,
    JournalError,
    JournalOpened,
    OwnershipLost,
    SessionHeader,
    open_shared_journal,
)
from inference_engine.journal.postgres import PostgresJournal, redact_url
from tests.support.postgres import PostgresServer, fresh_database, postgres  # noqa: F401 - fixture

MODEL = {"model": "/models/a", "backend": "torch", "vocab_size": 100}


def _header(session_id: str) -> SessionHeader:
    return SessionHeader(
        session_id=session_id,
        label=f"label-{session_id}",
        eos_token_ids=(2, 7),
        kv_strategy="sink_window",
        sink=2,
        window=16,
        kv_compressor="kakeya_d4:38",
    )


@pytest.fixture
def url(postgres: PostgresServer) -> str:  # noqa: F811 - the imported fixture
    return fresh_database(postgres)


def _backend(url: str, node: str) -> PostgresJournal:
    backend = PostgresJournal(url, node=node)
    assert backend.load(MODEL) == []
    return backend


def test_a_session_written_by_one_daemon_is_taken_over_by_another_with_its_whole_history(url: str) -> None:
    a, b = _backend(url, "a"), _backend(url, "b")
    now = time.time()
    assert a.write([JournalOpened(_header("s1"), (5, 6), now)]) == frozenset()
    assert a.write([JournalAppended("s1", (7,), now), JournalAppended("s1", (8, 9), now + 1)]) == frozenset()
    record = b.take_over("s1")
    assert record is not None
    assert record.header == _header("s1")
    assert record.tokens == [5, 6, 7, 8, 9]
    assert record.last_active_unix == pytest.approx(now + 1)
    assert b.owner("s1") == ("b", 2)
    assert b.take_over("missing") is None
    a.close()
    b.close()


def test_a_stale_owner_loses_the_session_and_its_writes_are_refused(url: str) -> None:
    a, b = _backend(url, "a"), _backend(url, "b")
    now = time.time()
    a.write([JournalOpened(_header("s1"), (5,), now), JournalOpened(_header("s2"), (1,), now)])
    assert b.take_over("s1") is not None
    # a's append to s1 is refused; its append to s2 (still its own) in the same transaction is kept
    assert a.write([JournalAppended("s1", (66,), now), JournalAppended("s2", (2,), now)]) == frozenset({"s1"})
    assert a.write([JournalEnded("s1")]) == frozenset({"s1"})  # a cannot end a session it lost
    assert b.write([JournalAppended("s1", (6,), now)]) == frozenset()
    c = _backend(url, "c")
    s1, s2 = c.take_over("s1"), c.take_over("s2")
    assert s1 is not None and s1.tokens == [5, 6]
    assert s2 is not None and s2.tokens == [1, 2]
    for backend in (a, b, c):
        backend.close()


def test_the_writer_reports_a_lost_session_to_its_caller_only(url: str) -> None:
    async def scenario() -> None:
        journal_a = Journal(_backend(url, "a"))
        b = _backend(url, "b")
        await journal_a.write(JournalOpened(_header("s1"), (5,), time.time()))
        await journal_a.write(JournalOpened(_header("s2"), (5,), time.time()))
        assert await asyncio.to_thread(b.take_over, "s1") is not None
        lost = journal_a.submit(JournalAppended("s1", (9,), time.time()))
        kept = journal_a.submit(JournalAppended("s2", (9,), time.time()))
        with pytest.raises(OwnershipLost):
            await asyncio.wrap_future(lost)
        await asyncio.wrap_future(kept)
        record = await journal_a.take_over("s1")  # taking it back gives a a new epoch: its writes count again
        assert record is not None and record.tokens == [5]
        await journal_a.write(JournalAppended("s1", (10,), time.time()))
        assert b.owner("s1") == ("a", 3)
        journal_a.close()
        b.close()

    asyncio.run(scenario())


def test_an_ended_session_is_gone_for_every_daemon(url: str) -> None:
    a, b = _backend(url, "a"), _backend(url, "b")
    a.write([JournalOpened(_header("s1"), (5,), time.time())])
    assert a.write([JournalEnded("s1")]) == frozenset()
    assert b.take_over("s1") is None
    a.close()
    b.close()


def test_a_journal_holding_sessions_of_another_model_is_refused(url: str) -> None:
    a = _backend(url, "a")
    a.write([JournalOpened(_header("s1"), (5,), time.time())])
    with pytest.raises(JournalError, match="same model"):
        open_shared_journal(url, {**MODEL, "vocab_size": 101}, node="b", sync="normal")
    a.close()


def test_an_unreachable_server_is_a_journal_error_without_the_password() -> None:
    with pytest.raises(JournalError, match="cannot connect") as caught:
        PostgresJournal("postgresql://kakeya:secret@127.0.0.1:1/none", node="a", connect_timeout_s=1)
    assert "secret" not in str(caught.value)
    assert redact_url("postgresql://u:pw@h:5/d") == "postgresql://u:***@h:5/d"
