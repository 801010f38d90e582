"""Bad input seen in the field, each a typed error (or an ordinary event) that leaves other sessions intact:
huge sink/window, a history tail longer than the history, a body that is not protobuf, and an HTTP client that
disconnects mid-body."""

from __future__ import annotations

import logging
import socket
import time

import grpc
import pytest

from inference_engine.generated import runtime_pb2 as pb
from tests.support.server import create, generate, info

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)


@pytest.fixture
def server(serve):
    return serve("qwen3", max_history_tokens=4096)


@pytest.fixture
def witness(server):
    """A session whose greedy continuation must be unaffected by every bad call around it."""
    sid = create(server.stub, initial=[5, 6, 7, 8])
    expected = generate(server.stub, create(server.stub, initial=[5, 6, 7, 8]), max_tokens=6).tokens
    yield sid
    assert generate(server.stub, sid, max_tokens=6).tokens == expected


@pytest.mark.parametrize(("sink", "window"), [(0, 2**32 - 1), (2**32 - 1, 1), (4000, 97), (2**31, 2**31)])
def test_sink_and_window_above_the_history_limit_are_invalid(server, witness, sink, window):
    request = pb.CreateSessionRequest(kv_strategy=pb.KV_STRATEGY_SINK_WINDOW, sink_tokens=sink, window_tokens=window)
    with pytest.raises(grpc.RpcError) as error:
        server.stub.CreateSession(request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-history-tokens" in (error.value.details() or "")


def test_sink_and_window_at_the_history_limit_are_accepted(server, witness):
    request = pb.CreateSessionRequest(
        kv_strategy=pb.KV_STRATEGY_SINK_WINDOW, sink_tokens=96, window_tokens=4000, initial_token_ids=[1, 2]
    )
    sid = server.stub.CreateSession(request).session_id
    assert len(generate(server.stub, sid, max_tokens=2).tokens) == 2


@pytest.mark.parametrize(("tail", "expected"), [(9, 9), (10, 10), (11, 10), (15, 10), (4096, 10)])
def test_a_history_tail_longer_than_the_history_returns_the_whole_history(server, witness, tail, expected):
    history = list(range(20, 30))
    sid = create(server.stub, initial=history)
    assert list(info(server.stub, sid, tail=tail).history_tail_token_ids) == history[-expected:]


@pytest.mark.parametrize("method", ["CreateSession", "AppendTokens", "GetSessionInfo", "ForkSession"])
def test_a_body_that_is_not_protobuf_is_invalid_argument(server, witness, method):
    call = server.channel.unary_unary(f"/kakeya.v1.RuntimeService/{method}")
    with pytest.raises(grpc.RpcError) as error:
        call(b"\xff\xff\xff\xff\x0f", timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not a valid kakeya.v1." in (error.value.details() or "")


def test_a_generate_body_that_is_not_protobuf_is_invalid_argument(server, witness):
    call = server.channel.unary_stream("/kakeya.v1.RuntimeService/Generate")
    with pytest.raises(grpc.RpcError) as error:
        list(call(b"\x0a\xff", timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_converse_body_that_is_not_protobuf_is_invalid_argument(server, witness):
    call = server.channel.stream_stream("/kakeya.v1.RuntimeService/Converse")
    with pytest.raises(grpc.RpcError) as error:
        list(call(iter([b"\x0a\xff"]), timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_an_http_client_disconnecting_mid_body_is_logged_as_an_ordinary_event(serve, caplog):
    server = serve("qwen3", http_port=0)
    caplog.set_level(logging.INFO)
    port = server.server.http_port
    assert port is not None
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5000\r\n\r\n" + b'{"model": "x", "prompt": "' + b"a" * 100
        )
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any("client disconnected" in r.getMessage() for r in caplog.records):
        time.sleep(0.05)
    assert any(r.levelno == logging.INFO and "client disconnected" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "no ERROR, no traceback"
