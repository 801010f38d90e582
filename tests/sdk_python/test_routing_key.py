"""Every call of a session carries its routing key in `x-kakeya-routing-key` metadata, as a proxy in front of
several daemons needs it; recorded by a client interceptor on a real call path to a real daemon."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import kakeya
import pytest
from kakeya._channel import ROUTING_KEY_HEADER
from kakeya._generated.runtime_pb2_grpc import RuntimeServiceStub

from tests.support.server import RunningServer


class _Recorder(
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor, grpc.StreamStreamClientInterceptor
):
    """Records (method, routing key) of every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []

    def _record(self, details: grpc.ClientCallDetails) -> None:
        keys = [value for key, value in details.metadata or () if key == ROUTING_KEY_HEADER]
        assert len(keys) <= 1, keys
        self.calls.append((details.method.rsplit("/", 1)[-1], keys[0] if keys else None))

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        self._record(details)
        return continuation(details, request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        self._record(details)
        return continuation(details, request)

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        self._record(details)
        return continuation(details, requests)


@pytest.fixture
def recorded(server: RunningServer) -> Iterator[tuple[kakeya.Client, _Recorder]]:
    recorder = _Recorder()
    with kakeya.Client(server.address) as client:
        client.stub = RuntimeServiceStub(grpc.intercept_channel(client._channel, recorder))
        yield client, recorder


def test_every_call_of_a_session_and_of_its_forks_carries_one_random_routing_key(recorded: Any) -> None:
    client, recorder = recorded
    with client.create_session(initial_tokens=[3, 4, 5]) as session:
        key = session.routing_key
        assert key and key != session.id
        session.append([6])
        list(session.generate(2))
        session.info()
        with session.converse() as conversation:
            conversation.append([7])
        fork = session.fork()
        assert fork.routing_key == key
        fork.close()
    other = client.create_session(initial_tokens=[1])
    other.close()
    assert other.routing_key != key
    session_calls = [(m, k) for m, k in recorder.calls if m != "GetModelInfo"]
    methods = {m for m, _ in session_calls}
    assert {"CreateSession", "AppendTokens", "Generate", "GetSessionInfo", "Converse", "ForkSession"} <= methods
    assert {k for _, k in session_calls[:-2]} == {key}  # the last two calls belong to `other`
    assert [k for _, k in session_calls[-2:]] == [other.routing_key] * 2


def test_a_client_chooses_the_routing_key_and_a_reattached_handle_defaults_to_the_session_id(recorded: Any) -> None:
    client, recorder = recorded
    session = client.create_session(initial_tokens=[3], routing_key="tenant-7")
    assert session.routing_key == "tenant-7"
    assert client.session(session.id, routing_key="tenant-7").info().history_length == 1
    again = client.session(session.id)
    assert again.routing_key == session.id
    again.close()
    assert [k for m, k in recorder.calls if m != "GetModelInfo"] == ["tenant-7", "tenant-7", session.id]


@pytest.mark.parametrize("bad", ["", "line\nbreak", "ключ", 7])
def test_a_routing_key_the_metadata_cannot_carry_is_refused_before_sending(client: kakeya.Client, bad: Any) -> None:
    with pytest.raises(kakeya.InvalidArgument, match="routing_key"):
        client.create_session(routing_key=bad)
    with pytest.raises(kakeya.InvalidArgument, match="routing_key"):
        client.session("abc", routing_key=bad)
