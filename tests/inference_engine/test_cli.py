"""The console script as users run it: help, refusals, the bundled model, graceful shutdown."""

from __future__ import annotations

import subprocess

import grpc
import pytest

from inference_engine.config_sources import option_help
from inference_engine.generated import runtime_pb2 as pb
from inference_engine.generated import runtime_pb2_grpc
from tests.support.daemon import CONSOLE_SCRIPT, Daemon

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CONSOLE_SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_serve_help_documents_every_option_with_its_default_and_environment_variable():
    result = _run("serve", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for name, _, default, _, _ in option_help():
        flag = "--" + name.replace("_", "-")
        assert flag in text
        assert f"env KAKEYA_{name.upper()}" in text
        if name != "api_key" and default != "":
            assert f"(default: {default};" in text, name
    assert "--config FILE" in text


def test_top_level_help_lists_the_serve_command():
    result = _run("--help")
    assert result.returncode == 0 and "serve" in result.stdout


def test_non_loopback_bind_without_an_api_key_refuses_to_start():
    result = _run("serve", "--host", "0.0.0.0", "--port", "0")
    assert result.returncode == 2
    assert "refusing to bind non-loopback address" in result.stderr


def test_a_missing_model_directory_fails_with_a_clear_message(tmp_path):
    result = _run("serve", "--model", str(tmp_path / "absent"), "--port", "0", "--metrics-port", "-1")
    assert result.returncode == 2
    assert "no model directory or GGUF file at" in result.stderr
    assert "smollm2-135m-instruct, kakeya-tiny" in result.stderr, "the message names the models it knows"
    result = _run("serve", "--model", str(tmp_path), "--port", "0", "--metrics-port", "-1")
    assert result.returncode == 2
    assert "a directory without config.json" in result.stderr


@pytest.fixture
def daemon():
    started: list[Daemon] = []

    def start(*args: str, **kwargs) -> Daemon:
        process = Daemon(*args, **kwargs)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()


def test_serving_the_bundled_model_and_stopping_gracefully_on_sigterm(daemon):
    server = daemon("serve", "--port", "0", "--metrics-port", "-1", "--log-format", "json")
    host, port = server.wait_listening()
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
        sid = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=list(b"Hello"))).session_id
        stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_tokens=64))
        first = next(stream)
        assert first.WhichOneof("payload") == "token_id"
        server.terminate()  # the in-flight generation finishes within the grace period
        replies = list(stream)
    assert replies[-1].done.stop_reason == pb.STOP_REASON_MAX_TOKENS
    assert server.wait() == 0
    assert '"msg": "stopped"' in server.output


def test_sigterm_cancels_generations_that_outlast_the_grace_period(daemon):
    server = daemon(
        "serve",
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--shutdown-grace-s",
        "0.3",
        env={"KAKEYA_MAX_GENERATE_TOKENS": "100000"},
    )
    host, port = server.wait_listening()
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
        sid = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=[1, 2, 3])).session_id
        stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_tokens=100000))
        next(stream)
        server.terminate()
        replies = list(stream)
    assert replies[-1].done.stop_reason == pb.STOP_REASON_CANCELLED
    assert server.wait() == 0
    assert "grace period over" in server.output


def _generated(stub, session_id: str, max_tokens: int) -> list[int]:
    replies = stub.Generate(pb.GenerateRequest(session_id=session_id, max_tokens=max_tokens))
    return [r.token_id for r in replies if r.WhichOneof("payload") == "token_id"]


def test_sessions_come_back_under_their_ids_after_a_restart_with_state_dir(daemon, tmp_path):
    state = tmp_path / "state"
    args = ("serve", "--port", "0", "--metrics-port", "-1", "--log-format", "json", "--state-dir", str(state))
    first = daemon(*args)
    host, port = first.wait_listening()
    prompt = list(range(40, 80))
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
        full = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=prompt, client_label="a")).session_id
        before = _generated(stub, full, 6)
        windowed = stub.CreateSession(
            pb.CreateSessionRequest(
                kv_strategy=pb.KV_STRATEGY_SINK_WINDOW, sink_tokens=2, window_tokens=16, eos_token_ids=[7]
            )
        ).session_id
        stub.AppendTokens(pb.AppendTokensRequest(session_id=windowed, token_ids=prompt))
        closed = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=[1])).session_id
        stub.CloseSession(pb.CloseSessionRequest(session_id=closed))
    first.terminate()
    assert first.wait() == 0
    assert (state / "journal.sqlite3").is_file()

    second = daemon(*args)
    host, port = second.wait_listening()
    assert '"msg": "sessions restored", "sessions": 2' in second.output
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
        info = stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=full, history_tail_tokens=6))
        assert (info.history_length, info.pending_token_count) == (46, 46)
        assert list(info.history_tail_token_ids) == before and info.client_label == "a"
        info = stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=windowed))
        assert info.kv_strategy == pb.KV_STRATEGY_SINK_WINDOW and (info.sink_tokens, info.window_tokens) == (2, 16)
        with pytest.raises(grpc.RpcError) as missing:
            stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=closed))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND

        after = _generated(stub, full, 6)
        reset = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=prompt + before)).session_id
        assert after == _generated(stub, reset, 6), "the restored session continues as if never stopped"
        restored_window = _generated(stub, windowed, 6)
        fresh = stub.CreateSession(
            pb.CreateSessionRequest(
                kv_strategy=pb.KV_STRATEGY_SINK_WINDOW,
                sink_tokens=2,
                window_tokens=16,
                eos_token_ids=[7],
                initial_token_ids=prompt,
            )
        ).session_id
        assert restored_window == _generated(stub, fresh, 6)
        info = stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=windowed))
        assert info.evicted_token_count > 0 and info.resident_token_count <= 18


@pytest.mark.parametrize(
    ("snapshot", "message"),
    [
        ('{"format": 1, "model": {"model": "/elsewhere"}, "sessions": []}', "was written for"),
        ("{not json", "cannot read the session snapshot"),
    ],
)
def test_a_snapshot_that_does_not_fit_is_refused_at_start(tmp_path, snapshot, message):
    (tmp_path / "sessions.json").write_text(snapshot)
    result = _run("serve", "--port", "0", "--metrics-port", "-1", "--state-dir", str(tmp_path))
    assert result.returncode == 1
    assert message in result.stderr
    assert (tmp_path / "sessions.json").read_text() == snapshot, "a refused snapshot is left as it was"
