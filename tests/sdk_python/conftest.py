"""Fixtures of the SDK tests: a real daemon on a loopback ephemeral port and SDK clients connected to it."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import kakeya
import pytest

from tests.support.server import RunningServer, create, generate

FAST_RETRY = kakeya.RetryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.1)


@pytest.fixture
def server(serve: Callable[..., RunningServer]) -> RunningServer:
    return serve("qwen3")


@pytest.fixture
def client(server: RunningServer) -> Iterator[kakeya.Client]:
    with kakeya.Client(server.address) as sdk_client:
        yield sdk_client


@pytest.fixture
def free_port() -> int:
    """A loopback port with nothing listening on it (bound once, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def reference_tokens(server: RunningServer, history: list[int], max_tokens: int, **kwargs: Any) -> list[int]:
    """Greedy tokens of a fresh session holding `history`, through the raw generated stub (not the SDK)."""
    return generate(server.stub, create(server.stub, initial=history), max_tokens=max_tokens, **kwargs).tokens


def busy_slot(client: kakeya.Client) -> kakeya.TokenStream:
    """Start a long generation that holds the server's only generation slot (max_concurrent=1)."""
    blocker = client.create_session(initial_tokens=[1, 2, 3], label="blocker")
    stream = blocker.generate(8000)
    next(stream)  # the slot is now taken
    return stream
