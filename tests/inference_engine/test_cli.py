"""The console script as users run it: help, refusals, the bundled model, graceful shutdown."""

from __future__ import annotations

import subprocess

import grpc
import pytest

from inference_engine.config import option_help
from inference_engine.generated import runtime_pb2 as pb
from inference_engine.generated import runtime_pb2_grpc
from tests.support.daemon import CONSOLE_SCRIPT, Daemon


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
    assert result.returncode == 1
    assert "config.json is missing" in result.stderr


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
