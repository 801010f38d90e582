"""ForkSession through the running server: the fork copies the parent's K/V (no prefill), both continue
independently, and each equals a fresh session given the same history, on both backends and both KV strategies."""

from __future__ import annotations

import random

import grpc
import pytest

from inference_engine.generated import runtime_pb2 as pb
from tests.support.backends import BACKENDS
from tests.support.checkpoints import VOCAB_SIZE
from tests.support.server import create, generate, info

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

STRATEGIES = {
    "full": {"kv_strategy": "full"},
    "sink_window": {"kv_strategy": "sink_window", "sink": 2, "window": 9},
    "dlm_restore": {"kv_strategy": "dlm_restore", "sink": 2, "window": 9},
}
CASES = [(b, s) for b in BACKENDS for s in STRATEGIES]


def _fork(stub, session_id: str, **kwargs) -> pb.ForkSessionResponse:
    return stub.ForkSession(pb.ForkSessionRequest(session_id=session_id, **kwargs))


def _fresh_tokens(stub, history: list[int], max_tokens: int) -> list[int]:
    return generate(stub, create(stub, initial=history), max_tokens=max_tokens).tokens


@pytest.mark.parametrize(("backend", "strategy"), CASES, ids=[f"{b}-{s}" for b, s in CASES])
def test_a_fork_copies_the_kv_and_both_sessions_continue_like_fresh_ones(serve, backend, strategy):
    server = serve("qwen3", **STRATEGIES[strategy])
    stub = server.stub
    rng = random.Random(5)
    prompt = [rng.randrange(VOCAB_SIZE - 1) for _ in range(24)]
    parent = create(stub, initial=prompt, client_label="parent")
    first = generate(stub, parent, max_tokens=6).tokens
    history = prompt + first

    reply = _fork(stub, parent)
    fork = reply.session_id
    assert fork != parent and reply.history_length == len(history)
    assert reply.copied_token_count == len(history) - 1, "every committed position is copied"
    fork_info = info(stub, fork, tail=len(history))
    assert list(fork_info.history_tail_token_ids) == history and fork_info.client_label == "parent"
    assert fork_info.pending_token_count == 1

    # Diverge: each gets its own turn; neither sees the other's tokens.
    turn_a = [rng.randrange(VOCAB_SIZE - 1) for _ in range(3)]
    turn_b = [rng.randrange(VOCAB_SIZE - 1) for _ in range(5)]
    stub.AppendTokens(pb.AppendTokensRequest(session_id=parent, token_ids=turn_a))
    stub.AppendTokens(pb.AppendTokensRequest(session_id=fork, token_ids=turn_b))
    fork_run = generate(stub, fork, max_tokens=7)
    parent_run = generate(stub, parent, max_tokens=7)
    assert fork_run.done.prefill_token_count == len(turn_b) + 1, "the fork prefilled only its new tokens"
    assert parent_run.done.prefill_token_count == len(turn_a) + 1
    assert parent_run.tokens == _fresh_tokens(stub, history + turn_a, 7)
    assert fork_run.tokens == _fresh_tokens(stub, history + turn_b, 7)
    assert info(stub, parent).history_length == len(history) + 3 + 7
    assert info(stub, fork).history_length == len(history) + 5 + 7


@pytest.mark.parametrize(("backend", "strategy"), CASES, ids=[f"{b}-{s}" for b, s in CASES])
def test_a_prefix_fork_continues_like_a_fresh_session_of_that_prefix(serve, backend, strategy):
    server = serve("qwen3", **STRATEGIES[strategy])
    stub = server.stub
    rng = random.Random(9)
    prompt = [rng.randrange(VOCAB_SIZE - 1) for _ in range(30)]
    parent = create(stub, initial=prompt)
    generate(stub, parent, max_tokens=4)
    reply = _fork(stub, parent, prefix_tokens=20, client_label="branch")
    assert reply.history_length == 20 and info(stub, reply.session_id).client_label == "branch"
    run = generate(stub, reply.session_id, max_tokens=6)
    if strategy == "full":
        assert reply.copied_token_count == 19 and run.done.prefill_token_count == 1
    else:
        # The window already evicted positions the prefix needs: the fork re-prefills its history.
        assert reply.copied_token_count == 0 and run.done.prefill_token_count == 20
    assert run.tokens == _fresh_tokens(stub, prompt[:20], 6)


def test_a_fork_of_a_session_with_pending_tokens_copies_only_the_committed_positions(serve):
    server = serve("qwen3")
    stub = server.stub
    parent = create(stub, initial=list(range(10, 30)))
    generate(stub, parent, max_tokens=3)
    stub.AppendTokens(pb.AppendTokensRequest(session_id=parent, token_ids=[5, 6, 7]))
    reply = _fork(stub, parent)
    assert (reply.history_length, reply.copied_token_count) == (26, 22)
    history = list(info(stub, parent, tail=26).history_tail_token_ids)
    assert generate(stub, reply.session_id, max_tokens=5).tokens == _fresh_tokens(stub, history, 5)


def test_a_fork_of_a_generating_session_waits_its_turn(serve):
    server = serve("qwen3")
    stub = server.stub
    parent = create(stub, initial=list(range(10, 20)))
    stream = stub.Generate(pb.GenerateRequest(session_id=parent, max_tokens=40))
    next(stream)
    fork = _fork(stub, parent)  # blocks until the generation is done
    rest = list(stream)
    assert rest[-1].done.stop_reason == pb.STOP_REASON_MAX_TOKENS
    assert fork.history_length == 50 and fork.copied_token_count == 49


@pytest.mark.parametrize("proposer", ["ngram", "draft_model", "dflash"])
def test_forks_of_speculative_sessions_give_the_tokens_of_fresh_ones(serve, checkpoints, tmp_path, proposer):
    from tests.support.checkpoints import save_dflash_drafter

    settings = {
        "ngram": {"proposer": "ngram"},
        "draft_model": {"proposer": "draft_model", "draft_model": str(checkpoints["qwen3"])},
        "dflash": {"proposer": "dflash", "draft_model": str(save_dflash_drafter(tmp_path / "dflash"))},
    }[proposer]
    server = serve("qwen3", **settings)
    stub = server.stub
    motif = [11, 12, 13, 14, 15, 16]
    parent = create(stub, initial=motif * 4)
    history = motif * 4 + generate(stub, parent, max_tokens=8).tokens
    fork = _fork(stub, parent)
    assert fork.copied_token_count == len(history) - 1
    run = generate(stub, fork.session_id, max_tokens=10)
    assert run.done.prefill_token_count == 1
    assert run.tokens == _fresh_tokens(stub, history, 10)
    assert generate(stub, parent, max_tokens=10).tokens == run.tokens


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"session_id": "missing"}, grpc.StatusCode.NOT_FOUND),
        ({"session_id": ""}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prefix_tokens": 11}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prefix_tokens": 2**63}, grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_bad_fork_requests_get_typed_errors_and_leave_the_parent_intact(serve, kwargs, code):
    server = serve("qwen3")
    stub = server.stub
    parent = create(stub, initial=list(range(10, 20)))
    with pytest.raises(grpc.RpcError) as error:
        stub.ForkSession(pb.ForkSessionRequest(**{"session_id": parent, **kwargs}))
    assert error.value.code() == code
    assert info(stub, parent).history_length == 10
    assert len(generate(stub, parent, max_tokens=3).tokens) == 3
