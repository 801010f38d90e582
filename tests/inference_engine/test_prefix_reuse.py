"""A session's first generation copies the K/V of the prefix it shares with an idle session, prefills only the rest,
and generates the tokens it would have generated alone."""

from __future__ import annotations

import pytest

from inference_engine.generated import runtime_pb2 as pb
from tests.support.server import create, generate

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

SHARED = [(7 * i) % 120 + 3 for i in range(100)]  # a system prompt and tool definitions, say (vocabulary: 128)
FIRST = [*SHARED, 7, 8, 9]
SECOND = [*SHARED, 100, 101, 102, 103, 104]


def _reused(server) -> float:
    text = server.metrics_text()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("kakeya_session_prefix_reused_positions_total ")
    )


def test_a_new_session_starts_from_the_prefix_an_idle_session_shares_with_it(serve):
    alone = serve("qwen3")
    expected = generate(alone.stub, create(alone.stub, initial=SECOND), max_tokens=12).tokens
    assert _reused(alone) == 0

    server = serve("qwen3")
    generate(server.stub, create(server.stub, initial=FIRST), max_tokens=6)
    second = generate(server.stub, create(server.stub, initial=SECOND), max_tokens=12)
    assert second.tokens == expected
    assert second.done is not None and second.done.prefill_token_count == len(SECOND) - len(SHARED)
    assert _reused(server) == len(SHARED)


def test_a_history_that_is_the_lenders_own_leaves_its_last_token_pending(serve):
    server = serve("qwen3")
    first = create(server.stub, initial=FIRST)
    generate(server.stub, first, max_tokens=6)
    twin = generate(server.stub, create(server.stub, initial=FIRST), max_tokens=6)
    assert twin.done is not None and twin.done.prefill_token_count == 1
    assert _reused(server) == len(FIRST) - 1


def test_short_prefixes_other_strategies_and_compressed_sessions_prefill_their_own(serve):
    server = serve("qwen3")
    generate(server.stub, create(server.stub, initial=FIRST), max_tokens=6)
    short = generate(server.stub, create(server.stub, initial=[*SHARED[:20], 1, 2, 3]), max_tokens=4)
    assert short.done is not None and short.done.prefill_token_count == 23
    window = create(
        server.stub, initial=SECOND, kv_strategy=pb.KV_STRATEGY_SINK_WINDOW, sink_tokens=4, window_tokens=64
    )
    packed = create(server.stub, initial=SECOND, kv_compressor=pb.KV_COMPRESSOR_KAKEYA_D4)
    for session in (window, packed):
        done = generate(server.stub, session, max_tokens=4).done
        assert done is not None and done.prefill_token_count == len(SECOND)
    assert _reused(server) == 0
