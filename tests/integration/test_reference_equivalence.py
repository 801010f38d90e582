"""The served streams of every backend against transformers references of the same weights: full == generate(),
continuation == reset, sink_window == the masked full-attention reference."""

from __future__ import annotations

import random

import pytest
import torch

from inference_engine.generated import runtime_pb2 as pb
from tests.support.backends import BACKENDS
from tests.support.checkpoints import VOCAB_SIZE
from tests.support.server import create, generate, info

ARCHS = ["qwen3", "llama", "gemma3"]

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("backend", BACKENDS)]


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_full_greedy_equals_transformers_generate(serve, reference_models, arch):
    server = serve(arch, kv_strategy="full", prefill_chunk_tokens=8)
    prompt = _tokens(11, 33)
    served = generate(server.stub, create(server.stub, initial=prompt), max_tokens=40).tokens
    model = reference_models[arch]
    with torch.no_grad():
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, 33:].tolist()
    assert len(set(reference)) > 3
    assert served == reference


@pytest.mark.parametrize("arch", ARCHS)
def test_multi_turn_continuation_equals_a_fresh_session_given_the_whole_history(serve, arch):
    server = serve(arch, kv_strategy="full")
    turns = [_tokens(20 + i, 9) for i in range(3)]
    history: list[int] = []
    sid = create(server.stub)
    for turn in turns:
        server.stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=turn))
        history += turn
        continued = generate(server.stub, sid, max_tokens=10).tokens
        fresh = generate(server.stub, create(server.stub, initial=history), max_tokens=10).tokens
        assert continued == fresh
        history += continued
    assert info(server.stub, sid).history_length == len(history)


def test_sink_window_reports_truncation_and_holds_flat_kv_bytes(serve):
    # Without a proposer: a draft's block grows the cache's staging room once, up to the longest block verified,
    # which the flat bytes below do not allow for.
    server = serve("qwen3", kv_strategy="sink_window", sink=4, window=16, proposer="none")
    sid = create(server.stub, initial=_tokens(1, 10))
    first = generate(server.stub, sid, max_tokens=4)
    assert first.truncated == []  # 13 positions committed: nothing evicted yet
    sizes, dropped = [], []
    for turn in range(6):
        server.stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=_tokens(40 + turn, 8)))
        result = generate(server.stub, sid, max_tokens=6)
        details = info(server.stub, sid)
        # Reported when the first token is out: every position before it is committed, 20 stay resident.
        assert result.truncated == [details.history_length - len(result.tokens) - 20]
        assert details.resident_token_count == 20
        assert details.evicted_token_count == details.history_length - 1 - 20
        sizes.append(details.kv_live_bytes)
        dropped.append(result.truncated[0])
    assert len(set(sizes)) == 1 and sizes[0] > 0
    assert dropped == sorted(dropped) and dropped[0] > 0
    assert details.kv_strategy == pb.KV_STRATEGY_SINK_WINDOW
    assert (details.sink_tokens, details.window_tokens) == (4, 16)


def test_sink_window_served_tokens_equal_the_masked_full_attention_reference(serve, reference_models):
    server = serve("llama", kv_strategy="sink_window", sink=2, window=12)
    prompt = _tokens(8, 40)
    served = generate(server.stub, create(server.stub, initial=prompt), max_tokens=20).tokens
    model, tokens = reference_models["llama"], list(prompt)
    for _ in range(20):  # greedy decoding with an explicit sink + window mask over the whole sequence
        positions = torch.arange(len(tokens))
        q, k = positions[:, None], positions[None, :]
        allowed = (k <= q) & ((k < 2) | (q - k <= 12))
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens]), attention_mask=allowed[None, None]).logits
        tokens.append(int(logits[0, -1].argmax()))
    assert served == tokens[40:]


def test_per_session_strategy_overrides_the_server_default(serve):
    server = serve("qwen3", kv_strategy="full")
    sid = create(
        server.stub, initial=_tokens(3, 30), kv_strategy=pb.KV_STRATEGY_SINK_WINDOW, sink_tokens=2, window_tokens=5
    )
    generate(server.stub, sid, max_tokens=3)
    details = info(server.stub, sid)
    assert details.kv_strategy == pb.KV_STRATEGY_SINK_WINDOW and details.resident_token_count == 7
    default = create(server.stub, initial=_tokens(3, 30))
    generate(server.stub, default, max_tokens=3)
    assert info(server.stub, default).kv_strategy == pb.KV_STRATEGY_FULL
