"""--state-dir as operators meet it: refusals at start, the explicit salvage, restored sessions under the TTL."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time

import grpc
import pytest

from inference_engine.generated import runtime_pb2 as pb
from inference_engine.generated import runtime_pb2_grpc
from inference_engine.journal import JournalOpened, SessionHeader
from inference_engine.journal.sqlite import FILE_NAME, SqliteJournal
from tests.support.daemon import CONSOLE_SCRIPT, Daemon
from tests.support.server import create, info

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)


def _serve(state, *flags: str) -> subprocess.CompletedProcess[str]:
    """A start that must fail before it listens."""
    command = [str(CONSOLE_SCRIPT), "serve", "--port", "0", "--metrics-port", "-1", "--state-dir", str(state), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _journal_with(state, model: dict, *records: tuple[str, tuple[int, ...]]) -> None:
    backend = SqliteJournal(state)
    backend.load(model)
    header = SessionHeader("", "", (), "full", 0, 0)
    backend.write([JournalOpened(_with_id(header, sid), tokens, time.time()) for sid, tokens in records])
    backend.close()


def _with_id(header: SessionHeader, session_id: str) -> SessionHeader:
    return SessionHeader(session_id, header.label, header.eos_token_ids, header.kv_strategy, header.sink, header.window)


@pytest.fixture(scope="module")
def bundled_identity(tmp_path_factory) -> dict:
    """The model identity the bundled model's daemon stamps into its journal."""
    state = tmp_path_factory.mktemp("identity")
    process = Daemon("serve", "--port", "0", "--metrics-port", "-1", "--state-dir", str(state))
    try:
        process.wait_listening()
    finally:
        process.kill()
    with sqlite3.connect(state / FILE_NAME) as db:
        return json.loads(db.execute("SELECT value FROM meta WHERE key = 'model'").fetchone()[0])


def test_a_damaged_journal_stops_the_start_and_is_left_untouched(tmp_path):
    (tmp_path / FILE_NAME).write_bytes(b"garbage" * 500)
    result = _serve(tmp_path)
    assert result.returncode == 1
    assert "damaged" in result.stderr and "--journal-recovery salvage" in result.stderr
    assert (tmp_path / FILE_NAME).read_bytes() == b"garbage" * 500


def test_a_journal_of_another_model_stops_the_start(tmp_path, bundled_identity):
    _journal_with(tmp_path, {**bundled_identity, "vocab_size": 7}, ("s", (1, 2)))
    result = _serve(tmp_path)
    assert result.returncode == 1 and "was written for" in result.stderr


def test_salvage_is_an_explicit_choice_and_names_what_it_dropped(tmp_path, bundled_identity):
    vocab = bundled_identity["vocab_size"]
    _journal_with(tmp_path, bundled_identity, ("good", (5, 6, 7)), ("outside", (5, vocab + 3)))
    refused = _serve(tmp_path)
    assert refused.returncode == 1
    assert "'outside' cannot be restored" in refused.stderr and "--journal-recovery salvage" in refused.stderr

    process = Daemon(
        "serve", "--port", "0", "--metrics-port", "-1", "--state-dir", str(tmp_path), "--journal-recovery", "salvage"
    )
    try:
        host, port = process.wait_listening()
        assert "session journal salvaged" in process.output and "'outside'" in process.output
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
            assert info(stub, "good", tail=3).history_tail_token_ids == [5, 6, 7]
            with pytest.raises(grpc.RpcError) as missing:
                info(stub, "outside")
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        process.kill()
    assert [r.header.session_id for r in SqliteJournal(tmp_path).load(bundled_identity)] == ["good"]


def test_restored_sessions_idle_past_the_ttl_are_evicted_like_any_other(serve, tmp_path):
    first = serve("qwen3", state_dir=str(tmp_path))
    old = create(first.stub, initial=[1, 2, 3])
    first.stop()
    with sqlite3.connect(tmp_path / FILE_NAME) as db:
        db.execute("UPDATE sessions SET last_active_unix = last_active_unix - 1000")

    second = serve("qwen3", state_dir=str(tmp_path), session_idle_ttl_s=2.0)
    fresh = create(second.stub, initial=[4])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            info(second.stub, old)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND and "ttl" in (exc.details() or "")
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the restored idle session was not evicted")
    assert info(second.stub, fresh).history_length == 1
    second.stop()
    restored = SqliteJournal(tmp_path).load(second.runtime.journal_identity())
    assert old not in {r.header.session_id for r in restored}, "the eviction is journaled"


def test_a_fork_is_journaled_and_comes_back_after_a_restart(serve, tmp_path):
    first = serve("qwen3", state_dir=str(tmp_path))
    parent = create(first.stub, initial=list(range(10, 20)))
    fork = first.stub.ForkSession(pb.ForkSessionRequest(session_id=parent, prefix_tokens=6)).session_id
    first.stop()
    second = serve("qwen3", state_dir=str(tmp_path))
    assert list(info(second.stub, fork, tail=10).history_tail_token_ids) == list(range(10, 16))
    assert info(second.stub, parent).history_length == 10
