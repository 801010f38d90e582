"""The SQLite journal through its public interface: round trips, the model check, damage, permissions, failures."""

from __future__ import annotations

import asyncio
import sqlite3
import stat
from pathlib import Path

import pytest

from inference_engine.journal import (
    Journal,
    JournalAppended,
    JournalDamaged,
    JournalEnded,
    JournalError,
    JournalOpened,
    SessionHeader,
    open_journal,
)
from inference_engine.journal.sqlite import FILE_NAME, SqliteJournal

MODEL = {"model": "/models/a", "backend": "torch", "vocab_size": 100}


def _header(session_id: str, **overrides: object) -> SessionHeader:
    fields: dict[str, object] = {
        "session_id": session_id,
        "label": f"label-{session_id}",
        "eos_token_ids": (2, 7),
        "kv_strategy": "sink_window",
        "sink": 2,
        "window": 16,
    }
    fields.update(overrides)
    return SessionHeader(**fields)  # type: ignore[arg-type]


def _write(directory: Path, *entries: object, sync: str = "normal") -> None:
    backend = SqliteJournal(directory, sync=sync)
    backend.load(MODEL)
    journal = Journal(backend)
    journal.submit(*entries).result(10)  # type: ignore[arg-type]
    journal.close()


def test_sessions_read_back_with_header_and_every_token_in_order(tmp_path):
    _write(
        tmp_path,
        JournalOpened(_header("a"), (1, 2, 3), 100.0),
        JournalOpened(_header("b", kv_strategy="full", sink=0, window=0), (), 101.0),
        JournalAppended("a", (4, 5), 102.0),
        JournalAppended("b", (9,), 103.0),
        JournalAppended("a", (6,), 104.0),
        JournalOpened(_header("gone"), (1,), 99.0),
        JournalEnded("gone"),
    )
    records = SqliteJournal(tmp_path).load(MODEL)
    assert [r.header.session_id for r in records] == ["b", "a"], "least recently active first"
    b, a = records
    assert a.tokens == [1, 2, 3, 4, 5, 6] and a.last_active_unix == 104.0
    assert a.header == _header("a")
    assert b.tokens == [9] and b.header.kv_strategy == "full"


@pytest.mark.parametrize("sync", ["normal", "full"])
def test_both_sync_policies_run_in_wal_mode(tmp_path, sync):
    _write(tmp_path, JournalOpened(_header("a"), (1,), 1.0), sync=sync)
    with sqlite3.connect(tmp_path / FILE_NAME) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert [r.tokens for r in SqliteJournal(tmp_path, sync=sync).load(MODEL)] == [[1]]


def test_a_start_compacts_each_history_into_one_row(tmp_path):
    _write(tmp_path, JournalOpened(_header("a"), (1,), 1.0), *(JournalAppended("a", (t,), 2.0) for t in range(50)))
    assert SqliteJournal(tmp_path).load(MODEL)[0].tokens == [1, *range(50)]
    with sqlite3.connect(tmp_path / FILE_NAME) as db:
        assert db.execute("SELECT count(*) FROM chunks").fetchone()[0] == 1
    assert SqliteJournal(tmp_path).load(MODEL)[0].tokens == [1, *range(50)]


def test_a_journal_of_another_model_is_refused_while_it_holds_sessions(tmp_path):
    _write(tmp_path, JournalOpened(_header("a"), (1,), 1.0))
    with pytest.raises(JournalError, match="was written for"):
        SqliteJournal(tmp_path).load({**MODEL, "model": "/models/b"})
    assert SqliteJournal(tmp_path).load(MODEL)[0].tokens == [1], "a refused journal is left as it was"


def test_an_empty_journal_is_taken_over_by_another_model(tmp_path):
    _write(tmp_path, JournalOpened(_header("a"), (1,), 1.0), JournalEnded("a"))
    other = {**MODEL, "vocab_size": 5}
    assert SqliteJournal(tmp_path).load(other) == []
    with pytest.raises(JournalError, match="was written for"):
        backend = SqliteJournal(tmp_path)
        backend.write([JournalOpened(_header("b"), (1,), 1.0)])
        SqliteJournal(tmp_path).load(MODEL)


def test_a_damaged_file_is_refused_and_left_in_place(tmp_path):
    (tmp_path / FILE_NAME).write_bytes(b"this is not a database" * 100)
    with pytest.raises(JournalDamaged, match="--journal-recovery salvage"):
        open_journal(tmp_path, MODEL, sync="normal", recovery="refuse")
    assert (tmp_path / FILE_NAME).read_bytes() == b"this is not a database" * 100


def test_salvage_moves_a_damaged_file_aside_and_says_everything_was_dropped(tmp_path):
    (tmp_path / FILE_NAME).write_bytes(b"this is not a database" * 100)
    opened = open_journal(tmp_path, MODEL, sync="normal", recovery="salvage")
    try:
        assert opened.records == []
        assert opened.dropped and "every session" in opened.dropped[0]
        assert opened.moved_to is not None and opened.moved_to.read_bytes().startswith(b"this is not")
        opened.journal.submit(JournalOpened(_header("new"), (3,), 1.0)).result(10)
    finally:
        opened.journal.close()
    assert [r.header.session_id for r in SqliteJournal(tmp_path).load(MODEL)] == ["new"]


def test_salvage_keeps_the_sessions_that_read_back_and_names_the_one_dropped(tmp_path):
    _write(tmp_path, JournalOpened(_header("good"), (1, 2), 1.0), JournalOpened(_header("bad"), (3,), 2.0))
    with sqlite3.connect(tmp_path / FILE_NAME) as db:
        db.execute("UPDATE chunks SET tokens = x'010203' WHERE session_id = 'bad'")
    with pytest.raises(JournalDamaged, match="not a whole number"):
        open_journal(tmp_path, MODEL, sync="normal", recovery="refuse")
    opened = open_journal(tmp_path, MODEL, sync="normal", recovery="salvage")
    opened.journal.close()
    assert [r.header.session_id for r in opened.records] == ["good"]
    assert len(opened.dropped) == 1 and "'bad'" in opened.dropped[0]
    assert [r.tokens for r in SqliteJournal(tmp_path).load(MODEL)] == [[1, 2]]


def test_the_state_dir_is_owner_only_and_so_is_every_file_in_it(tmp_path):
    state = tmp_path / "state"
    _write(state, JournalOpened(_header("a"), (1,), 1.0), JournalAppended("a", (2,), 2.0))
    backend = SqliteJournal(state)  # keep a connection open so the WAL side files exist
    backend.write([JournalAppended("a", (3,), 3.0)])
    try:
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        files = list(state.iterdir())
        assert {f.name for f in files} >= {FILE_NAME, FILE_NAME + "-wal", FILE_NAME + "-shm"}
        for path in files:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name
    finally:
        backend.close()


def test_an_existing_state_dir_is_made_owner_only(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    SqliteJournal(state).close()
    assert stat.S_IMODE(state.stat().st_mode) == 0o700


def test_a_state_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "state").write_text("")
    with pytest.raises(JournalError, match="not a directory"):
        SqliteJournal(tmp_path / "state")


def test_a_failed_write_fails_every_waiter_of_its_commit_and_the_writer_keeps_going(tmp_path):
    backend = SqliteJournal(tmp_path)
    backend.load(MODEL)
    journal = Journal(backend)
    journal.submit(JournalOpened(_header("a"), (1,), 1.0)).result(10)
    with sqlite3.connect(tmp_path / FILE_NAME) as db:
        db.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON chunks WHEN NEW.session_id = 'x' "
            "BEGIN SELECT RAISE(ABORT, 'no'); END"
        )
    with pytest.raises(JournalError, match="no"):
        journal.submit(JournalAppended("x", (1,), 2.0)).result(10)
    journal.submit(JournalAppended("a", (2,), 3.0)).result(10)
    journal.close()
    with pytest.raises(JournalError, match="closed"):
        journal.submit(JournalAppended("a", (3,), 4.0)).result(10)
    assert SqliteJournal(tmp_path).load(MODEL)[0].tokens == [1, 2]


def test_concurrent_writers_on_the_event_loop_all_commit(tmp_path):
    backend = SqliteJournal(tmp_path)
    backend.load(MODEL)
    journal = Journal(backend)

    async def main() -> None:
        await journal.write(*(JournalOpened(_header(str(i)), (), 1.0) for i in range(8)))
        await asyncio.gather(*(journal.write(JournalAppended(str(i % 8), (i,), 2.0)) for i in range(400)))
        await journal.flush()

    asyncio.run(main())
    journal.close()
    records = SqliteJournal(tmp_path).load(MODEL)
    assert sorted(t for r in records for t in r.tokens) == list(range(400))
    for record in records:
        assert record.tokens == sorted(record.tokens), "each session's tokens keep their order"
