"""Session lifecycle on a running server: eviction, concurrency, queueing, cancellation and close."""

from __future__ import annotations

import threading
import time

import grpc
import kakeya
import pytest

from inference_engine.generated import runtime_pb2 as pb
from inference_engine.generation import Generation
from tests.support.backends import BACKENDS
from tests.support.server import create, generate, info

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

NOT_FOUND = grpc.StatusCode.NOT_FOUND


def _not_found_reason(stub, sid) -> str:
    with pytest.raises(grpc.RpcError) as err:
        info(stub, sid)
    assert err.value.code() == NOT_FOUND
    return err.value.details()


def _wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


@pytest.mark.parametrize("backend", BACKENDS)
def test_idle_sessions_are_evicted_after_the_ttl(serve):
    # A TTL long enough that a loaded machine's gap between the create and the generate call never reaches it.
    server = serve("qwen3", session_idle_ttl_s=2.0)
    sid = create(server.stub, initial=[1, 2, 3])
    generate(server.stub, sid, max_tokens=2)
    _wait_until(lambda: len(server.runtime.store) == 0)
    assert "evicted: ttl" in _not_found_reason(server.stub, sid)
    assert 'kakeya_session_evicted_total{reason="ttl"} 1.0' in server.metrics_text()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_store_evicts_the_least_recently_used_idle_session(serve):
    server = serve("qwen3", max_sessions=2)
    first = create(server.stub, initial=[1])
    second = create(server.stub, initial=[2])
    server.stub.AppendTokens(pb.AppendTokensRequest(session_id=first, token_ids=[3]))  # first is now the most recent
    third = create(server.stub, initial=[4])
    assert "evicted: lru" in _not_found_reason(server.stub, second)
    assert info(server.stub, first).history_length == 2 and info(server.stub, third).history_length == 1
    assert 'kakeya_session_evicted_total{reason="lru"} 1.0' in server.metrics_text()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_kv_budget_evicts_idle_sessions_least_recent_first(serve):
    server = serve("qwen3", kv_budget_bytes=400_000)
    # About 165 kB each once parked (a parked session holds exactly its positions' K/V, and the default proposer's
    # index of them, about 40 kB): two fit, three do not. The
    # histories differ from their first token, so no session starts from another's K/V (a borrowed prefix makes the
    # first generation grow its room as a later generation does, beyond this budget for one session).
    sessions = [create(server.stub, initial=[1 + (i + k) % 120 for i in range(158)]) for k in range(3)]
    for sid in sessions:
        generate(server.stub, sid, max_tokens=2)
    live = [sid for sid in sessions if sid in {s.session_id for s in server.runtime.store.sessions()}]
    assert live == sessions[-len(live) :] and len(live) < 3
    assert "evicted: budget" in _not_found_reason(server.stub, sessions[0])
    assert server.runtime.store.kv_live_bytes() <= 400_000
    assert 'kakeya_session_evicted_total{reason="budget"}' in server.metrics_text()


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_generations_on_two_sessions_match_sequential_ones(serve):
    server = serve("llama", max_concurrent=2)
    prompts = {"a": [1, 2, 3, 4], "b": [9, 8, 7]}
    expected = {
        k: generate(server.stub, create(server.stub, initial=p), max_tokens=40).tokens for k, p in prompts.items()
    }
    sids = {k: create(server.stub, initial=p) for k, p in prompts.items()}
    results: dict[str, list[int]] = {}
    threads = [
        threading.Thread(
            target=lambda k=k: results.__setitem__(k, generate(server.stub, sids[k], max_tokens=40).tokens)
        )
        for k in prompts
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == expected


def test_a_second_generate_on_a_busy_session_waits_for_the_first(serve):
    server = serve("qwen3")
    sid = create(server.stub, initial=[1, 2, 3])
    first = server.stub.Generate(pb.GenerateRequest(session_id=sid, max_tokens=300))
    next(first)  # the first generation holds the session
    second_result: list = []
    waiter = threading.Thread(target=lambda: second_result.append(generate(server.stub, sid, max_tokens=5)))
    waiter.start()
    rest = list(first)
    waiter.join()
    assert rest[-1].done.generated_token_count == 300
    second = second_result[0]
    assert second.done.prefill_token_count == 1, "the second generation must start after the first one ended"
    assert info(server.stub, sid).history_length == 3 + 300 + 5


def test_other_sessions_keep_appending_while_one_generates(serve):
    server = serve("qwen3")
    busy = create(server.stub, initial=[1, 2])
    idle = create(server.stub, initial=[5])
    stream = server.stub.Generate(pb.GenerateRequest(session_id=busy, max_tokens=4000))
    next(stream)
    reply = server.stub.AppendTokens(pb.AppendTokensRequest(session_id=idle, token_ids=[6, 7]), timeout=5)
    assert reply.history_length == 3
    assert info(server.stub, busy).generating
    stream.cancel()


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancelling_mid_stream_leaves_a_consistent_history(serve):
    server = serve("qwen3")
    prompt = [4, 8, 15, 16, 23, 42]
    sid = create(server.stub, initial=prompt)
    stream = server.stub.Generate(pb.GenerateRequest(session_id=sid, max_tokens=5000))
    received = []
    for reply in stream:
        received.append(reply.token_id)
        if len(received) == 7:
            stream.cancel()
            break
    _wait_until(lambda: not info(server.stub, sid).generating)
    details = info(server.stub, sid, tail=50)
    assert 6 + 7 <= details.history_length < 6 + 5000
    history = prompt + list(details.history_tail_token_ids)[-(details.history_length - 6) :]
    assert history[: 6 + 7] == prompt + received, "the history starts with exactly what was streamed"
    assert server.runtime.store.get(sid, touch=False).seq.tokens == history
    continued = generate(server.stub, sid, max_tokens=12).tokens
    assert continued == generate(server.stub, create(server.stub, initial=history), max_tokens=12).tokens
    assert 'kakeya_generate_requests_total{outcome="cancelled"} 1.0' in server.metrics_text()


@pytest.mark.parametrize("backend", BACKENDS)
def test_closing_a_generating_session_cancels_the_generation(serve):
    server = serve("qwen3")
    sid = create(server.stub, initial=[1, 2, 3])
    stream = server.stub.Generate(pb.GenerateRequest(session_id=sid, max_tokens=5000))
    next(stream)
    closed = server.stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    replies = list(stream)
    done = replies[-1].done
    assert done.stop_reason == pb.STOP_REASON_CANCELLED
    assert closed.final_history_length == 3 + done.generated_token_count
    assert "closed" in _not_found_reason(server.stub, sid)
    assert server.runtime.store.kv_live_bytes() == 0


def test_a_client_that_lets_go_of_the_call_at_done_leaves_its_session_parked_and_idle(serve, monkeypatch):
    """The SDK returns at GenerateDone and drops the call, which cancels it on the server while the generation is
    still winding up (here: the engine is slow to let go of it); the wind-up still runs to its end."""
    server = serve("qwen3", queue_deadline_s=20.0)
    end = Generation.end

    def slow_end(self):
        time.sleep(0.3)
        end(self)

    monkeypatch.setattr(Generation, "end", slow_end)
    with kakeya.Client(server.address) as client:
        session = client.create_session(initial_tokens=[1, 2, 3], kv_compressor="kakeya_d4")
        for _ in range(2):
            assert len(list(session.generate(max_tokens=4))) == 4
            started = time.monotonic()
            described = session.info()
            assert time.monotonic() - started < 5.0  # not the queue deadline: nothing is left finishing
            assert not described.generating
            assert described.kv_compressed_bytes < described.kv_live_bytes < described.kv_compressed_bytes + 4096
