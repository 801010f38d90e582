"""Every metric of SPEC §8 is exported on /metrics and moves when it should."""

from __future__ import annotations

import re

from inference_engine.generated import runtime_pb2 as pb
from tests.support.server import create, generate

REQUIRED = [
    "session_active",
    "session_total",
    "session_kv_live_bytes",
    "session_history_tokens",
    "generate_prefill_tokens",
    "generate_prefill_duration_seconds",
    "cache_invariant_violations_total",
    "session_evicted_total",
    "generate_time_to_first_token_seconds",
    "generate_inter_token_latency_seconds",
    "generate_tokens_total",
    "speculative_draft_tokens_total",
    "speculative_accepted_tokens_total",
    "speculative_acceptance_length",
    "verifier_forwards_total",
    "kv_compression_ratio",
]


def _value(text: str, sample: str) -> float:
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    assert match, f"{sample} not exported"
    return float(match.group(1))


def test_every_required_metric_is_exported(serve):
    text = serve("qwen3").metrics_text()
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    exported = names | {name + "_total" for name in names}
    missing = [name for name in REQUIRED if name not in exported]
    assert not missing


def test_metrics_move_with_sessions_and_generations(serve):
    server = serve("qwen3", kv_strategy="sink_window", sink=2, window=8)
    before = server.metrics_text()
    assert _value(before, "session_active") == 0
    sid = create(server.stub, initial=list(range(1, 21)))
    result = generate(server.stub, sid, max_tokens=5)
    server.stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=[3, 4, 5]))
    generate(server.stub, sid, max_tokens=4)
    text = server.metrics_text()
    assert _value(text, "session_active") == 1
    assert _value(text, "session_kv_live_bytes") > 0
    assert _value(text, "generate_tokens_total") == len(result.tokens) + 4 == 9
    assert _value(text, "generate_prefill_tokens_count") == 2
    assert _value(text, "generate_prefill_tokens_sum") == 20 + (1 + 3)
    assert _value(text, "session_history_tokens_sum") == 20 + (25 + 3)
    assert _value(text, "generate_prefill_duration_seconds_count") == 2
    assert _value(text, "generate_time_to_first_token_seconds_count") == 2
    assert _value(text, "generate_inter_token_latency_seconds_count") == 4 + 3
    assert _value(text, "verifier_forwards_total") == 9
    assert _value(text, 'generate_requests_total{outcome="max_tokens"}') == 2
    assert _value(text, "kv_compression_ratio") == 1.0
    server.stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    after = server.metrics_text()
    assert _value(after, "session_active") == 0 and _value(after, "session_kv_live_bytes") == 0
    assert _value(after, 'session_total{outcome="closed"}') == 1
