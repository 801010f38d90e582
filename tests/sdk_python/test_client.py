"""The synchronous client against a real daemon: every method of Client, Session and TokenStream."""

from __future__ import annotations

import kakeya
import pytest
from kakeya import KvStrategy, StopReason

from tests.sdk_python.conftest import reference_tokens


def test_a_session_round_trip_creates_appends_generates_describes_and_closes(server, client):
    session = client.create_session(initial_tokens=[1, 2, 3], label="round-trip")
    assert session.info().pending_token_count == 3
    assert session.append([4, 5]) == 5
    tokens = list(session.generate(8))
    assert tokens == reference_tokens(server, [1, 2, 3, 4, 5], 8)
    stats = session.last_generation
    assert stats is not None and stats.server_reported
    assert stats.stop_reason is StopReason.MAX_TOKENS
    assert (stats.generated_token_count, stats.prefill_token_count, stats.truncated_token_count) == (8, 5, 0)
    assert stats.verifier_forward_count >= 8 and 0 < stats.prefill_duration_s <= stats.total_duration_s
    info = session.info(history_tail_tokens=8)
    assert (info.history_length, info.label, info.kv_strategy) == (13, "round-trip", KvStrategy.FULL)
    assert info.history_tail == tuple(tokens) and info.invariant_violations == 0 and not info.generating
    assert info.kv_live_bytes > 0 and info.resident_token_count == 12 and info.pending_token_count == 1
    assert session.close() == 13
    with pytest.raises(kakeya.SessionNotFound):
        session.info()


def test_the_token_stream_reports_its_tokens_and_statistics(client):
    session = client.create_session(initial_tokens=[9, 8, 7])
    stream = session.generate(5)
    assert stream.stats is None and stream.tokens == []
    tokens = list(stream)
    assert stream.tokens == tokens and len(tokens) == 5
    assert stream.stats == session.last_generation and stream.stats.generated_token_count == 5
    assert list(stream) == [], "an ended stream yields nothing more"


def test_seeded_sampling_is_reproducible_and_the_sampling_parameters_reach_the_server(server, client):
    def sample(**kwargs):
        return list(client.create_session(initial_tokens=[5, 6, 7]).generate(16, **kwargs))

    assert sample(seed=7, temperature=1.0) == sample(seed=7, temperature=1.0)
    assert sample(seed=7, temperature=1.0) != sample(seed=8, temperature=1.0)
    assert sample(seed=3, temperature=1.5, top_k=1) == reference_tokens(server, [5, 6, 7], 16)
    assert sample(seed=3, temperature=1.0, top_p=1e-6) == reference_tokens(server, [5, 6, 7], 16)


def test_stop_tokens_and_session_eos_tokens_end_a_generation_with_eos(server, client):
    greedy = reference_tokens(server, [4, 4, 2], 12)
    stop = greedy[3]
    cut = greedy[: greedy.index(stop) + 1]
    session = client.create_session(initial_tokens=[4, 4, 2])
    assert list(session.generate(12, stop_token_ids=[stop])) == cut
    assert session.last_generation.stop_reason is StopReason.EOS
    eos_session = client.create_session(initial_tokens=[4, 4, 2], eos_token_ids=[stop])
    assert list(eos_session.generate(12)) == cut


def test_a_sink_window_session_reports_its_strategy_and_the_truncation(client):
    session = client.create_session(
        initial_tokens=list(range(1, 31)), kv_strategy="sink_window", sink_tokens=2, window_tokens=8
    )
    stream = session.generate(4)
    tokens = list(stream)
    assert len(tokens) == 4 and stream.truncated_token_count > 0
    assert session.last_generation.truncated_token_count == stream.truncated_token_count
    info = session.info()
    assert info.kv_strategy is KvStrategy.SINK_WINDOW and (info.sink_tokens, info.window_tokens) == (2, 8)
    assert info.resident_token_count == 10 and info.evicted_token_count == info.history_length - 1 - 10


def test_a_session_handle_attaches_to_an_existing_session(client):
    created = client.create_session(initial_tokens=[1, 2])
    attached = client.session(created.id)
    assert attached.append([3]) == 3 and created.info().history_length == 3
    assert repr(attached) == f"Session({created.id!r})"


def test_leaving_a_session_block_closes_it_and_an_explicit_close_is_not_repeated(client):
    with client.create_session(initial_tokens=[1]) as session:
        session.append([2])
    with pytest.raises(kakeya.SessionNotFound):
        client.session(session.id).info()
    with client.create_session() as closed_early:
        assert closed_early.close() == 0


def test_an_error_inside_a_session_block_is_the_one_reported(client):
    with pytest.raises(RuntimeError) as error, client.create_session() as session:
        client.session(session.id).close()  # closed behind this handle's back: its own close fails too
        raise RuntimeError("the error of the block")
    assert "NOT_FOUND" in error.value.__notes__[0]


def test_the_client_is_a_context_manager_and_waits_until_ready(server):
    with kakeya.Client(server.address) as client:
        client.wait_until_ready(10)
        assert client.create_session(initial_tokens=[1]).info().history_length == 1


def test_values_the_wire_cannot_carry_are_refused_before_sending(client):
    session = client.create_session(initial_tokens=[1])
    for call in (
        lambda: session.append([-1]),
        lambda: session.append([2**32]),
        lambda: session.append("hello"),
        lambda: session.append([1.5]),
        lambda: session.append([True]),
        lambda: session.generate(-1),
        lambda: session.generate(4, seed=-3),
        lambda: session.generate(4, top_k=-1),
        lambda: session.generate(4, temperature="hot"),
        lambda: session.generate(4, inter_token_timeout_s=0),
        lambda: session.info(history_tail_tokens=-1),
        lambda: client.create_session(kv_strategy="lru"),
        lambda: client.create_session(label=3),
        lambda: client.session(""),
        lambda: kakeya.Client(""),
        lambda: kakeya.Client("127.0.0.1:1", timeout_s=0),
        lambda: kakeya.Client("127.0.0.1:1", api_key=""),
        lambda: kakeya.Client("127.0.0.1:1", tls="yes"),
    ):
        with pytest.raises(kakeya.InvalidArgument) as error:
            call()
        assert error.value.status is None and isinstance(error.value, ValueError)
    assert session.info().history_length == 1
