"""Random RPC sequences against a running server: nothing crashes, every error is typed, no invariant breaks.

A model of each session's history length is kept alongside; every successful call must agree with it, every
failing call must leave it unchanged.
"""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
    run_state_machine_as_test,
)

from inference_engine.generated import runtime_pb2 as pb
from tests.support.checkpoints import VOCAB_SIZE
from tests.support.server import RunningServer

TYPED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
LIMITS = {"max_generate_tokens": 8, "max_append_tokens": 24, "max_history_tokens": 60, "max_sessions": 4}

tokens = st.one_of(
    st.lists(st.integers(min_value=0, max_value=VOCAB_SIZE - 1), min_size=1, max_size=20),
    st.lists(st.integers(min_value=0, max_value=VOCAB_SIZE + 3), max_size=30),
)
foreign_ids = st.one_of(st.just(""), st.text(min_size=1, max_size=40))


def _valid_tokens(ids: list[int]) -> bool:
    return all(t < VOCAB_SIZE for t in ids)


class RpcSequences(RuleBasedStateMachine):
    server: RunningServer

    sessions = Bundle("sessions")

    def __init__(self) -> None:
        super().__init__()
        self.lengths: dict[str, int] = {}

    def _call(self, fn, *args):
        """Run a call; returns (reply, None) or (None, status code). Untyped statuses fail the test."""
        try:
            reply = fn(*args)
            if hasattr(reply, "__next__"):
                reply = list(reply)
            return reply, None
        except grpc.RpcError as err:
            assert err.code() in TYPED, (err.code(), err.details())
            return None, err.code()

    def _alive(self, sid: str) -> bool:
        live = {s.session_id for s in self.server.runtime.store.sessions()}
        for gone in set(self.lengths) - live:  # evicted least recently used by a later create
            del self.lengths[gone]
        return sid in self.lengths

    @rule(target=sessions, initial=tokens)
    def create(self, initial):
        reply, code = self._call(self.server.stub.CreateSession, pb.CreateSessionRequest(initial_token_ids=initial))
        if code is None:
            assert _valid_tokens(initial) and len(initial) <= LIMITS["max_append_tokens"]
            self.lengths[reply.session_id] = len(initial)
            return reply.session_id
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
        return "never-created"

    @rule(sid=sessions, ids=tokens)
    def append(self, sid, ids):
        before = self.lengths.get(sid)
        reply, code = self._call(self.server.stub.AppendTokens, pb.AppendTokensRequest(session_id=sid, token_ids=ids))
        if code is None:
            assert before is not None and _valid_tokens(ids)
            self.lengths[sid] = before + len(ids)
            assert reply.history_length == self.lengths[sid]
        elif code == grpc.StatusCode.NOT_FOUND:
            assert not self._alive(sid)

    @rule(
        sid=sessions,
        max_tokens=st.integers(min_value=1, max_value=LIMITS["max_generate_tokens"]),
        temperature=st.one_of(st.none(), st.floats(0.0, 2.0, width=32, allow_subnormal=False)),
        top_p=st.one_of(st.none(), st.floats(0.0625, 1.0, width=32, allow_subnormal=False)),
        top_k=st.one_of(st.none(), st.integers(min_value=0, max_value=VOCAB_SIZE * 2)),
        seed=st.one_of(st.none(), st.integers(min_value=0, max_value=2**64 - 1)),
    )
    def generate(self, sid, max_tokens, temperature, top_p, top_k, seed):
        request = pb.GenerateRequest(
            session_id=sid, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
        )
        replies, code = self._call(self.server.stub.Generate, request)
        if code is not None:
            alive = self._alive(sid)
            assert (code, alive) in {
                (grpc.StatusCode.NOT_FOUND, False),
                (grpc.StatusCode.INVALID_ARGUMENT, alive and self.lengths.get(sid) == 0),
                (grpc.StatusCode.RESOURCE_EXHAUSTED, alive and self.lengths[sid] >= LIMITS["max_history_tokens"]),
            }
            return
        done = replies[-1].done
        generated = [r.token_id for r in replies if r.WhichOneof("payload") == "token_id"]
        assert done.generated_token_count == len(generated) <= max_tokens
        assert all(0 <= t < VOCAB_SIZE for t in generated)
        self.lengths[sid] += len(generated)

    @rule(
        sid=sessions,
        bad=st.sampled_from(
            [
                {"max_tokens": 0},
                {"max_tokens": LIMITS["max_generate_tokens"] + 1},
                {"temperature": math.nan},
                {"temperature": math.inf},
                {"temperature": -0.5},
                {"top_p": 0.0},
                {"top_p": 1.5},
                {"top_p": math.nan},
                {"stop_token_ids": [VOCAB_SIZE]},
            ]
        ),
    )
    def generate_with_a_bad_parameter(self, sid, bad):
        request = pb.GenerateRequest(session_id=sid, **{"max_tokens": 4, "temperature": 1.0, **bad})
        _, code = self._call(self.server.stub.Generate, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT

    @rule(target=sessions, sid=sessions, prefix=st.one_of(st.none(), st.integers(min_value=0, max_value=80)))
    def fork(self, sid, prefix):
        request = pb.ForkSessionRequest(session_id=sid, prefix_tokens=prefix)
        reply, code = self._call(self.server.stub.ForkSession, request)
        if code is None:
            parent = self.lengths[sid]
            expected = parent if prefix is None else prefix
            assert expected <= parent and reply.history_length == expected
            assert reply.copied_token_count <= max(expected - 1, 0)
            self.lengths[reply.session_id] = expected
            return reply.session_id
        alive = self._alive(sid)
        assert (code, alive) in {
            (grpc.StatusCode.NOT_FOUND, False),
            (grpc.StatusCode.INVALID_ARGUMENT, alive and prefix is not None and prefix > self.lengths[sid]),
            (grpc.StatusCode.RESOURCE_EXHAUSTED, alive),
        }
        return "never-created"

    @rule(sid=consumes(sessions))
    def close(self, sid):
        reply, code = self._call(self.server.stub.CloseSession, pb.CloseSessionRequest(session_id=sid))
        if code is None:
            assert reply.final_history_length == self.lengths.pop(sid)

    @rule(sid=foreign_ids)
    def foreign_id(self, sid):
        _, code = self._call(self.server.stub.GetSessionInfo, pb.GetSessionInfoRequest(session_id=sid))
        assert code == (grpc.StatusCode.INVALID_ARGUMENT if sid == "" else grpc.StatusCode.NOT_FOUND)

    @rule(sid=sessions)
    def info(self, sid):
        reply, code = self._call(self.server.stub.GetSessionInfo, pb.GetSessionInfoRequest(session_id=sid))
        if code is None:
            assert self._alive(sid) and reply.history_length == self.lengths[sid]
            assert reply.cache_invariant_inv1_violations == reply.cache_invariant_inv2_violations == 0
            assert reply.pending_token_count + reply.resident_token_count + reply.evicted_token_count == (
                reply.history_length
            )

    @invariant()
    def store_agrees_with_the_model(self):
        for session in self.server.runtime.store.sessions():
            if session.session_id in self.lengths:
                assert len(session.seq.tokens) == self.lengths[session.session_id]
        assert self.server.runtime.store.kv_live_bytes() <= 8 << 30


@pytest.mark.parametrize("strategy", ["full", "sink_window"])
def test_random_rpc_sequences_keep_the_server_consistent(serve, strategy):
    server = serve("qwen3", kv_strategy=strategy, sink=2, window=6, **LIMITS)
    RpcSequences.server = server
    budget = settings(max_examples=12, stateful_step_count=20, deadline=None, suppress_health_check=list(HealthCheck))
    run_state_machine_as_test(RpcSequences, settings=budget)
    assert 'kakeya_cache_invariant_violations_total{kind="inv1"} 0.0' in server.metrics_text()
    assert 'kakeya_cache_invariant_violations_total{kind="inv2"} 0.0' in server.metrics_text()
