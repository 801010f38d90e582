"""Stopping a generation early cancels it on the server; the inter-token timeout cancels a stalled stream."""

from __future__ import annotations

import time

import kakeya
import pytest
from kakeya import StopReason

from tests.sdk_python.conftest import busy_slot, reference_tokens


def _wait_idle(session: kakeya.Session) -> kakeya.SessionInfo:
    """The session's info once its generation has stopped on the server (it stops after its current step)."""
    deadline = time.monotonic() + 60
    while (info := session.info()).generating and time.monotonic() < deadline:
        time.sleep(0.02)
    return info


def test_breaking_out_of_generate_cancels_the_generation_on_the_server(server, client):
    session = client.create_session(initial_tokens=[1, 2, 3])
    received = []
    for token in session.generate(5000):
        received.append(token)
        if len(received) == 3:
            break
    stats = session.last_generation
    assert stats.stop_reason is StopReason.CANCELLED and not stats.server_reported
    assert stats.generated_token_count == 3
    info = _wait_idle(session)
    assert not info.generating and 3 + 3 <= info.history_length < 3 + 5000
    tail = session.info(history_tail_tokens=info.history_length - 3).history_tail
    assert list(tail[:3]) == received, "the received tokens are the first ones the history gained"
    # The request is counted when its call ends on the server, just after the session went idle.
    deadline = time.monotonic() + 10
    cancelled = 'kakeya_generate_requests_total{outcome="cancelled"} 1.0'
    while cancelled not in server.metrics_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cancelled in server.metrics_text()
    assert len(list(session.generate(4))) == 4, "the session is free for the next generation"


def test_closing_or_leaving_a_stream_block_cancels_it(client):
    session = client.create_session(initial_tokens=[4, 5, 6])
    stream = session.generate(5000)
    next(stream)
    stream.close()
    assert stream.stats.stop_reason is StopReason.CANCELLED
    assert list(stream) == []
    with session.generate(5000) as held:
        next(held)
    assert held.stats.stop_reason is StopReason.CANCELLED
    assert _wait_idle(session).history_length < 3 + 10000


def test_an_ended_stream_is_not_cancelled_by_closing_it(server, client):
    session = client.create_session(initial_tokens=[7, 8])
    with session.generate(6) as stream:
        tokens = list(stream)
    assert stream.stats.stop_reason is StopReason.MAX_TOKENS and stream.stats.server_reported
    assert tokens == reference_tokens(server, [7, 8], 6)


def test_a_stalled_stream_raises_inter_token_timeout_and_is_cancelled(client):
    blocker = busy_slot(client)
    session = client.create_session(initial_tokens=[4, 5])
    stream = session.generate(4, inter_token_timeout_s=0.3)  # queued behind the blocker: no token comes
    with pytest.raises(kakeya.InterTokenTimeout) as error:
        list(stream)
    assert "inter_token_timeout_s=0.3" in error.value.message
    assert stream.stats.stop_reason is StopReason.CANCELLED
    blocker.cancel()
    assert _wait_idle(session).history_length == 2, "the cancelled generation never ran"
    assert len(list(session.generate(3, inter_token_timeout_s=30))) == 3, "a flowing stream is not cut"
