"""Batched decoding through the running server: concurrent sessions share forwards, yet each gets exactly the
tokens it gets alone; a cancelled or failing session leaves the others of its forwards undisturbed."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from inference_engine.generated import runtime_pb2 as pb
from tests.support.backends import BACKENDS
from tests.support.checkpoints import VOCAB_SIZE
from tests.support.concurrently import concurrently
from tests.support.server import RunningServer, create, generate

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("backend", BACKENDS)]

SINK_WINDOW = {"kv_strategy": pb.KV_STRATEGY_SINK_WINDOW, "sink_tokens": 2, "window_tokens": 12}
# (session options, prompt length, generation options): full and sink_window, greedy and seeded sampling, and a
# prompt longer than the prefill chunk, so prefill chunks share forwards with decode steps.
SPECS: list[tuple[dict[str, Any], int, dict[str, Any]]] = [
    ({}, 6, {}),
    (SINK_WINDOW, 20, {}),
    ({}, 45, {"temperature": 0.9, "seed": 5}),
    (SINK_WINDOW, 9, {"temperature": 1.2, "top_k": 30, "seed": 8}),
    ({}, 2, {"temperature": 0.8, "top_p": 0.9, "seed": 13}),
    (SINK_WINDOW, 33, {}),
]
MAX_TOKENS = 24
PROPOSERS = {"none": {}, "ngram": {"proposer": "ngram", "num_draft_tokens": 5, "ngram_max_n": 3}}


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    base = [rng.randrange(VOCAB_SIZE) for _ in range(max(1, n // 3))]
    return (base * 4)[:n]  # repeats, so the ngram proposer finds drafts


def _session(server: RunningServer, index: int) -> str:
    options, length, _ = SPECS[index]
    return create(server.stub, initial=_prompt(index, length), **options)


def _sample(text: str, series: str) -> float:
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{series} is not exported"
    return float(found.group(1))


def _batched_forwards(server: RunningServer) -> tuple[int, int]:
    """(forwards that held more than one step, all forwards) from the batch size histogram."""
    text = server.metrics_text()
    single = _sample(text, 'kakeya_batch_size_bucket{le="1.0"}')
    return int(_sample(text, "kakeya_batch_size_count") - single), int(_sample(text, "kakeya_batch_size_count"))


def _serve(serve: Callable[..., RunningServer], proposer: str = "none") -> RunningServer:
    return serve(max_concurrent=8, max_batch_size=8, prefill_chunk_tokens=16, **PROPOSERS[proposer])


@pytest.mark.parametrize("proposer", list(PROPOSERS))
def test_concurrent_sessions_get_the_tokens_they_get_alone(serve, proposer):
    server = _serve(serve, proposer)
    alone = [
        generate(server.stub, _session(server, i), max_tokens=MAX_TOKENS, **SPECS[i][2]).tokens
        for i in range(len(SPECS))
    ]
    assert _batched_forwards(server)[0] == 0, "sessions generating one after another never share a forward"

    sessions = [_session(server, i) for i in range(len(SPECS))]
    together = concurrently(
        [
            lambda i=i: generate(server.stub, sessions[i], max_tokens=MAX_TOKENS, **SPECS[i][2]).tokens
            for i in range(len(SPECS))
        ]
    )

    assert together == alone
    shared, forwards = _batched_forwards(server)
    assert shared > 0, "the concurrent generations never shared a forward"
    steps = _sample(server.metrics_text(), "kakeya_verifier_forwards_total")
    assert forwards < steps, "batched forwards must be fewer than the sessions' steps"


def test_batch_size_one_runs_a_forward_per_step(serve):
    server = serve(max_concurrent=4, max_batch_size=1, decode_burst_tokens=1)
    sessions = [_session(server, i) for i in range(3)]
    concurrently([lambda s=s: generate(server.stub, s, max_tokens=8) for s in sessions])
    shared, forwards = _batched_forwards(server)
    assert shared == 0 and forwards >= 3 * 8


def test_cancelling_one_session_leaves_its_batch_mates_undisturbed(serve):
    server = _serve(serve)
    long = 40
    alone = [generate(server.stub, _session(server, i), max_tokens=long, **SPECS[i][2]).tokens for i in range(4)]
    sessions = [_session(server, i) for i in range(4)]

    def cancelled_after_three() -> list[int]:
        stream = server.stub.Generate(pb.GenerateRequest(session_id=sessions[0], max_tokens=long))
        received = []
        for reply in stream:
            received.append(reply.token_id)
            if len(received) == 3:
                stream.cancel()
                break
        return received

    calls: list[Callable[[], Any]] = [cancelled_after_three]
    calls += [
        lambda i=i: generate(server.stub, sessions[i], max_tokens=long, **SPECS[i][2]).tokens for i in range(1, 4)
    ]
    together = concurrently(calls)

    assert together[0] == alone[0][:3]
    assert together[1:] == alone[1:]
    assert _batched_forwards(server)[0] > 0
    # The cancelled session is intact: it goes on from where it stopped.
    info = server.stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sessions[0]))
    assert info.history_length >= len(_prompt(0, SPECS[0][1])) + 3
    assert len(generate(server.stub, sessions[0], max_tokens=4).tokens) == 4


def test_an_invariant_violation_inside_a_batch_fails_only_its_session(serve):
    server = _serve(serve)
    lone = [_session(server, i) for i in range(4)]
    alone = [generate(server.stub, lone[i], max_tokens=MAX_TOKENS, **SPECS[i][2]).tokens for i in range(4)]
    for session_id in lone:  # else a twin would lend its prefix, and the broken cache would be replaced unused
        server.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id))
    sessions = [_session(server, i) for i in range(4)]
    broken = server.runtime.store.get(sessions[2], touch=False)
    broken.seq.cache._layers[0].held += 1  # corrupt one layer's bookkeeping: its first commit finds it
    together = concurrently(
        [lambda i=i: generate(server.stub, sessions[i], max_tokens=MAX_TOKENS, **SPECS[i][2]).tokens for i in range(4)]
    )
    error = together[2]
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "inv1" in (error.details() or "")
    assert [together[i] for i in (0, 1, 3)] == [alone[i] for i in (0, 1, 3)]
    assert 'kakeya_cache_invariant_violations_total{kind="inv1"} 1.0' in server.metrics_text()
