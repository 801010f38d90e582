"""Every bad input of SPEC §4 / §12 gets its typed status from the running server and harms no other session."""

from __future__ import annotations

import math
import threading

import grpc
import pytest

from inference_engine.generated import runtime_pb2 as pb
from tests.support.backends import BACKENDS
from tests.support.checkpoints import VOCAB_SIZE
from tests.support.server import converse, create, generate, info

INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
NOT_FOUND = grpc.StatusCode.NOT_FOUND

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("backend", BACKENDS)]


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info_:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
    return info_.value.code()


@pytest.fixture
def server(serve):
    return serve(
        "qwen3", max_generate_tokens=64, max_append_tokens=50, max_history_tokens=120, max_message_bytes=64 * 1024
    )


@pytest.fixture
def witness(server):
    """A session whose greedy continuation must be unaffected by every failing call around it."""
    sid = create(server.stub, initial=[5, 6, 7, 8])
    expected = generate(server.stub, create(server.stub, initial=[5, 6, 7, 8]), max_tokens=8).tokens
    yield sid
    assert generate(server.stub, sid, max_tokens=8).tokens == expected


def _generate(server, sid, **kwargs):
    return lambda: list(server.stub.Generate(pb.GenerateRequest(session_id=sid, **kwargs)))


def test_unknown_session_is_not_found_everywhere(server, witness):
    stub, ghost = server.stub, "no-such-session"
    assert _code(lambda: stub.AppendTokens(pb.AppendTokensRequest(session_id=ghost, token_ids=[1]))) == NOT_FOUND
    assert _code(_generate(server, ghost, max_tokens=2)) == NOT_FOUND
    assert _code(lambda: stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=ghost))) == NOT_FOUND
    assert _code(lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=ghost))) == NOT_FOUND
    bind = [pb.ConverseRequest(command_id=1, bind=pb.BindCommand(session_id=ghost))]
    assert _code(lambda: converse(stub, bind)) == NOT_FOUND


def test_closed_session_is_not_found_and_says_so(server, witness):
    sid = create(server.stub, initial=[1, 2])
    assert server.stub.CloseSession(pb.CloseSessionRequest(session_id=sid)).final_history_length == 2
    with pytest.raises(grpc.RpcError) as err:
        info(server.stub, sid)
    assert err.value.code() == NOT_FOUND and "closed" in err.value.details()


def test_empty_session_id_is_invalid(server, witness):
    assert _code(lambda: server.stub.AppendTokens(pb.AppendTokensRequest(session_id="", token_ids=[1]))) == INVALID
    assert _code(_generate(server, "", max_tokens=2)) == INVALID
    assert _code(lambda: server.stub.CloseSession(pb.CloseSessionRequest(session_id=""))) == INVALID


def test_token_ids_outside_the_vocabulary_are_invalid(server, witness):
    stub = server.stub
    sid = create(stub, initial=[1])
    assert _code(lambda: stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=[VOCAB_SIZE]))) == INVALID
    assert _code(lambda: stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=[1, 2**31]))) == INVALID
    assert _code(lambda: stub.CreateSession(pb.CreateSessionRequest(eos_token_ids=[VOCAB_SIZE + 5]))) == INVALID
    assert _code(_generate(server, sid, max_tokens=2, stop_token_ids=[VOCAB_SIZE])) == INVALID
    assert info(stub, sid).history_length == 1, "a rejected append must not change the history"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": 65},
        {"max_tokens": 4, "temperature": math.nan},
        {"max_tokens": 4, "temperature": math.inf},
        {"max_tokens": 4, "temperature": -0.5},
        {"max_tokens": 4, "temperature": 1.0, "top_p": 0.0},
        {"max_tokens": 4, "temperature": 1.0, "top_p": 1.5},
        {"max_tokens": 4, "temperature": 1.0, "top_p": math.nan},
    ],
)
def test_out_of_range_generation_parameters_are_invalid(server, witness, kwargs):
    sid = create(server.stub, initial=[3, 4])
    assert _code(_generate(server, sid, **kwargs)) == INVALID
    assert info(server.stub, sid).history_length == 2


def test_generating_on_an_empty_history_is_invalid(server, witness):
    assert _code(_generate(server, create(server.stub), max_tokens=2)) == INVALID


def test_strategy_options_that_do_not_apply_are_invalid(server, witness):
    stub = server.stub
    assert (
        _code(lambda: stub.CreateSession(pb.CreateSessionRequest(kv_strategy=pb.KV_STRATEGY_FULL, sink_tokens=2)))
        == INVALID
    )
    assert (
        _code(
            lambda: stub.CreateSession(pb.CreateSessionRequest(kv_strategy=pb.KV_STRATEGY_SINK_WINDOW, window_tokens=0))
        )
        == INVALID
    )
    assert _code(lambda: stub.CreateSession(pb.CreateSessionRequest(kv_strategy=17))) == INVALID


def test_history_tail_above_the_limit_is_invalid(server, witness):
    sid = create(server.stub, initial=[1, 2, 3])
    assert info(server.stub, sid, tail=2).history_tail_token_ids == [2, 3]
    assert _code(lambda: info(server.stub, sid, tail=51)) == INVALID


def test_limits_are_resource_exhausted(server, witness):
    stub = server.stub
    sid = create(stub, initial=[1] * 50)
    assert _code(lambda: stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=[1] * 51))) == EXHAUSTED
    stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=[1] * 50))
    assert _code(lambda: stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=[1] * 21))) == EXHAUSTED
    assert _code(lambda: stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=[1] * 51))) == EXHAUSTED
    big = pb.AppendTokensRequest(session_id=sid, token_ids=[1] * 40000)  # over --max-message-bytes
    assert _code(lambda: stub.AppendTokens(big)) == EXHAUSTED
    assert info(stub, sid).history_length == 100


def test_a_generation_at_the_history_ceiling_stops_with_truncated(server, witness):
    sid = create(server.stub, initial=[2] * 50)
    server.stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=[3] * 50))
    result = generate(server.stub, sid, max_tokens=64)
    assert len(result.tokens) == 20 and result.done.stop_reason == pb.STOP_REASON_TRUNCATED
    assert _code(_generate(server, sid, max_tokens=4)) == EXHAUSTED


def test_all_sessions_busy_is_resource_exhausted(serve):
    server = serve("qwen3", max_sessions=1)
    sid = create(server.stub, initial=[1, 2, 3])
    stream = server.stub.Generate(pb.GenerateRequest(session_id=sid, max_tokens=2000))
    next(stream)  # the only session is now generating and cannot be evicted
    assert _code(lambda: server.stub.CreateSession(pb.CreateSessionRequest())) == EXHAUSTED
    stream.cancel()


def test_waiting_past_the_queue_deadline_is_resource_exhausted(serve):
    server = serve("qwen3", queue_deadline_s=0.2)
    sid = create(server.stub, initial=[1, 2, 3])
    stream = server.stub.Generate(pb.GenerateRequest(session_id=sid, max_tokens=4000))
    next(stream)
    assert _code(lambda: server.stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=[1]))) == EXHAUSTED
    other = create(server.stub, initial=[4, 5])
    assert _code(_generate(server, other, max_tokens=2)) == EXHAUSTED  # the single generation slot is taken
    stream.cancel()


def test_converse_requires_bind_first_and_a_command(server, witness):
    sid = create(server.stub, initial=[1, 2])
    append_first = [pb.ConverseRequest(command_id=1, append=pb.AppendCommand(token_ids=[3]))]
    assert _code(lambda: converse(server.stub, append_first)) == INVALID
    no_command = [pb.ConverseRequest(command_id=1, bind=pb.BindCommand(session_id=sid)), pb.ConverseRequest()]
    assert _code(lambda: converse(server.stub, no_command)) == INVALID
    rebind = [pb.ConverseRequest(command_id=1, bind=pb.BindCommand(session_id=sid))] * 2
    assert _code(lambda: converse(server.stub, rebind)) == INVALID
    assert info(server.stub, sid).history_length == 2


def test_an_invariant_violation_fails_and_frees_only_that_session(server, witness):
    sid = create(server.stub, initial=[1, 2, 3, 4])
    generate(server.stub, sid, max_tokens=3)
    session = server.runtime.store.get(sid, touch=False)
    session.seq.cache._layers[0].held += 1  # corrupt one layer's bookkeeping
    with pytest.raises(grpc.RpcError) as err:
        generate(server.stub, sid, max_tokens=3)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "inv1" in err.value.details()
    assert _code(lambda: info(server.stub, sid)) == NOT_FOUND
    assert session.seq.cache.nbytes == 0, "the failed session's memory must be freed"
    text = server.metrics_text()
    assert 'kakeya_cache_invariant_violations_total{kind="inv1"} 1.0' in text
    assert 'kakeya_session_total{outcome="failed"} 1.0' in text


def test_concurrent_bad_calls_do_not_disturb_a_generation(server, witness):
    sid = create(server.stub, initial=[9, 8, 7])
    expected = generate(server.stub, create(server.stub, initial=[9, 8, 7]), max_tokens=30).tokens
    errors: list[grpc.StatusCode] = []

    def hammer() -> None:
        for _ in range(20):
            errors.append(
                _code(lambda: server.stub.AppendTokens(pb.AppendTokensRequest(session_id="nope", token_ids=[1])))
            )

    thread = threading.Thread(target=hammer)
    thread.start()
    tokens = generate(server.stub, sid, max_tokens=30).tokens
    thread.join()
    assert tokens == expected and set(errors) == {NOT_FOUND}
