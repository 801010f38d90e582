"""Every metric of SPEC §8 is exported on /metrics and moves when it should."""

from __future__ import annotations

import re
import threading
import time

from inference_engine.generated import runtime_pb2 as pb
from tests.support.server import create, generate

REQUIRED = [
    "kakeya_session_active",
    "kakeya_session_total",
    "kakeya_session_kv_live_bytes",
    "kakeya_session_history_tokens",
    "kakeya_generate_prefill_tokens",
    "kakeya_generate_prefill_duration_seconds",
    "kakeya_cache_invariant_violations_total",
    "kakeya_session_evicted_total",
    "kakeya_generate_time_to_first_token_seconds",
    "kakeya_generate_inter_token_latency_seconds",
    "kakeya_generate_tokens_total",
    "kakeya_speculative_draft_tokens_total",
    "kakeya_speculative_accepted_tokens_total",
    "kakeya_speculative_acceptance_length",
    "kakeya_verifier_forwards_total",
    "kakeya_kv_compression_ratio",
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


def test_every_series_is_prefixed_and_none_is_a_created_timestamp(serve):
    server = serve("qwen3")
    generate(server.stub, create(server.stub, initial=[1, 2, 3]), max_tokens=3)
    samples = [line for line in server.metrics_text().splitlines() if line and not line.startswith("#")]
    assert samples
    assert [line for line in samples if not line.startswith("kakeya_")] == []
    assert [line for line in samples if "_created" in line.split(" ")[0]] == []
    build = next(line for line in samples if line.startswith("kakeya_build_info{"))
    assert 'backend="torch"' in build and 'proposer="ngram"' in build and build.endswith(" 1.0")


def test_queue_depth_counts_a_generation_waiting_for_the_only_slot(serve):
    server = serve("qwen3", max_concurrent=1)
    busy = server.stub.Generate(pb.GenerateRequest(session_id=create(server.stub, initial=[1, 2]), max_tokens=4000))
    next(busy)  # holds the only generation slot
    waiter = threading.Thread(
        target=generate, args=(server.stub, create(server.stub, initial=[3, 4])), kwargs={"max_tokens": 2}
    )
    waiter.start()
    deadline = time.monotonic() + 30
    while _value(server.metrics_text(), "kakeya_generate_queue_depth") != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _value(server.metrics_text(), "kakeya_generate_queue_depth") == 1
    busy.cancel()
    waiter.join(60)
    text = server.metrics_text()
    assert _value(text, "kakeya_generate_queue_depth") == 0
    assert _value(text, "kakeya_generate_queue_wait_seconds_count") == 2
    assert _value(text, "kakeya_generate_queue_wait_seconds_sum") > 0


def test_metrics_move_with_sessions_and_generations(serve):
    server = serve("qwen3", kv_strategy="sink_window", sink=2, window=8)
    before = server.metrics_text()
    assert _value(before, "kakeya_session_active") == 0
    sid = create(server.stub, initial=list(range(1, 21)))
    result = generate(server.stub, sid, max_tokens=5)
    server.stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=[3, 4, 5]))
    generate(server.stub, sid, max_tokens=4)
    text = server.metrics_text()
    assert _value(text, "kakeya_session_active") == 1
    assert _value(text, "kakeya_session_kv_live_bytes") > _value(text, "kakeya_draft_state_bytes") > 0  # ngram's index
    assert _value(text, "kakeya_generate_tokens_total") == len(result.tokens) + 4 == 9
    assert _value(text, "kakeya_generate_prefill_tokens_count") == 2
    assert _value(text, "kakeya_generate_prefill_tokens_sum") == 20 + (1 + 3)
    assert _value(text, "kakeya_session_history_tokens_sum") == 20 + (25 + 3)
    assert _value(text, "kakeya_generate_prefill_duration_seconds_count") == 2
    assert _value(text, "kakeya_generate_time_to_first_token_seconds_count") == 2
    assert _value(text, "kakeya_generate_inter_token_latency_seconds_count") == 4 + 3
    assert _value(text, "kakeya_verifier_forwards_total") == 9
    assert _value(text, 'kakeya_generate_requests_total{outcome="max_tokens"}') == 2
    assert _value(text, "kakeya_kv_compression_ratio") == 1.0
    server.stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    after = server.metrics_text()
    assert _value(after, "kakeya_session_active") == 0 and _value(after, "kakeya_session_kv_live_bytes") == 0
    assert _value(after, "kakeya_draft_state_bytes") == 0
    assert _value(after, 'kakeya_session_total{outcome="closed"}') == 1
