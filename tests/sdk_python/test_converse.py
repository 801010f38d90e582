"""`Session.converse()`: ordered append/generate/cancel commands on one bidirectional stream."""

from __future__ import annotations

import kakeya
import pytest
from kakeya import StopReason

from tests.sdk_python.conftest import busy_slot, reference_tokens
from tests.support.checkpoints import VOCAB_SIZE


def test_a_conversation_appends_and_generates_like_the_unary_calls(server, client):
    session = client.create_session(initial_tokens=[1, 2, 3])
    with session.converse() as conversation:
        assert conversation.history_length == 3
        assert conversation.append([4, 5]) == 5 and conversation.history_length == 5
        stream = conversation.generate(6)
        tokens = list(stream)
        assert tokens == reference_tokens(server, [1, 2, 3, 4, 5], 6)
        assert stream.stats.stop_reason is StopReason.MAX_TOKENS and stream.stats.server_reported
        assert stream.tokens == tokens and stream.truncated_token_count == 0
        assert session.last_generation == stream.stats
        assert conversation.append([6]) == 12
        assert list(conversation.generate(3, seed=1, temperature=1.0)) == list(
            client.create_session(initial_tokens=[1, 2, 3, 4, 5, *tokens, 6]).generate(3, seed=1, temperature=1.0)
        )
    assert session.info().history_length == 15


def test_breaking_out_of_a_conversation_generation_keeps_the_history_exact(client):
    session = client.create_session(initial_tokens=[7, 7, 7])
    with session.converse() as conversation:
        stream = conversation.generate(5000)
        for index, _ in enumerate(stream):
            if index == 2:
                break
        assert conversation.append([1]) > 3, "the next command drains the cancelled generation first"
        added = stream.tokens
        assert len(added) >= 3 and stream.stats.stop_reason is StopReason.CANCELLED
        assert stream.stats.generated_token_count == len(added)
    info = session.info(history_tail_tokens=len(added) + 1)
    assert info.history_length == 3 + len(added) + 1 and list(info.history_tail) == [*added, 1]


def test_cancel_waits_for_the_final_statistics(client):
    session = client.create_session(initial_tokens=[2, 4, 6])
    with session.converse() as conversation:
        assert conversation.cancel() is None, "nothing to cancel"
        stream = conversation.generate(5000)
        next(stream)
        stats = stream.cancel()
        assert stats is not None and stats.stop_reason is StopReason.CANCELLED and stats.server_reported
        assert list(stream) == []
        other = conversation.generate(5000)
        next(other)
        assert conversation.cancel().generated_token_count == len(other.tokens)
        with conversation.generate(5000) as held:
            next(held)
    assert session.info().history_length == 3 + len(stream.tokens) + len(other.tokens) + len(held.tokens)


def test_an_error_ends_the_conversation_and_names_the_cause(client):
    session = client.create_session(initial_tokens=[1])
    conversation = session.converse()
    with pytest.raises(kakeya.InvalidArgument) as error:
        conversation.append([VOCAB_SIZE])
    assert "outside the vocabulary" in error.value.message
    with pytest.raises(kakeya.InvalidArgument) as ended:
        conversation.generate(2)
    assert "the conversation has ended" in ended.value.message
    conversation.close()
    assert session.info().history_length == 1


def test_a_closed_conversation_refuses_commands_and_an_unknown_session_cannot_be_bound(client):
    conversation = client.create_session(initial_tokens=[1]).converse()
    conversation.close()
    conversation.close()
    with pytest.raises(kakeya.InvalidArgument):
        conversation.append([2])
    with pytest.raises(kakeya.SessionNotFound):
        client.session("ghost").converse()


def test_a_stalled_conversation_raises_inter_token_timeout(client):
    blocker = busy_slot(client)
    session = client.create_session(initial_tokens=[4, 5])
    conversation = session.converse(inter_token_timeout_s=0.3)
    with pytest.raises(kakeya.InterTokenTimeout):
        list(conversation.generate(4))
    with pytest.raises(kakeya.InterTokenTimeout):
        conversation.append([1])  # the conversation ended with the timeout
    conversation.close()
    blocker.cancel()
