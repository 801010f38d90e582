"""KV compression through the daemon: per-session and server-default compressors, what GetSessionInfo and
/metrics report, typed errors for bad choices, and more sessions under the same KV byte budget."""

from __future__ import annotations

import re
import time

import grpc
import kakeya
import pytest

from inference_engine.config import ConfigError
from inference_engine.config_sources import load_config
from inference_engine.generated import runtime_pb2 as pb
from kv_cache_proposer.compression import PackedLayerStore
from tests.support.backends import BACKENDS
from tests.support.server import create, generate, info

PROMPT = list(range(5, 45))


def _value(text: str, sample: str) -> float:
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    assert match, f"{sample} not exported"
    return float(match.group(1))


def test_a_compressed_session_reports_packed_bytes_in_session_info_and_metrics(serve):
    server = serve("qwen3")
    dense = create(server.stub, initial=PROMPT)
    packed = create(server.stub, initial=PROMPT, kv_compressor=pb.KV_COMPRESSOR_KAKEYA_D4, kv_q_range=38)
    for sid in (dense, packed):
        generate(server.stub, sid, max_tokens=6)
    dense_info, packed_info = info(server.stub, dense), info(server.stub, packed)
    assert packed_info.kv_compressor == pb.KV_COMPRESSOR_KAKEYA_D4 and packed_info.kv_q_range == 38
    assert dense_info.kv_compressor == pb.KV_COMPRESSOR_NONE and dense_info.kv_q_range == 0
    assert dense_info.kv_compressed_bytes == 0
    assert packed_info.kv_dense_equivalent_bytes == dense_info.kv_dense_equivalent_bytes > 0
    # Parked between generations: the session holds its packed bytes (plus the slot table), nothing dense, beside
    # what the default proposer (ngram) holds, reported apart.
    packed_kv = packed_info.kv_live_bytes - packed_info.draft_state_bytes
    assert packed_info.kv_compressed_bytes < packed_kv < packed_info.kv_compressed_bytes + 4096
    assert packed_kv * 3 < dense_info.kv_live_bytes - dense_info.draft_state_bytes
    assert packed_info.draft_state_bytes > 0
    # While generating it held its residents unpacked and a stage too: its peak is reported after the park.
    assert packed_info.kv_peak_bytes > packed_info.kv_live_bytes
    assert dense_info.kv_peak_bytes >= dense_info.kv_live_bytes
    text = server.metrics_text()
    peak = max(dense_info.kv_peak_bytes, packed_info.kv_peak_bytes)
    assert _value(text, "kakeya_kv_session_peak_bytes") == peak
    assert _value(text, "kakeya_kv_compressed_bytes") == packed_info.kv_compressed_bytes
    ratio = packed_info.kv_dense_equivalent_bytes / packed_info.kv_compressed_bytes
    assert _value(text, "kakeya_kv_compression_ratio") == pytest.approx(ratio)
    assert _value(text, "kakeya_kv_escaped_blocks") == packed_info.kv_escaped_blocks


@pytest.mark.parametrize("resting", [0, 1])
def test_session_info_asked_the_moment_a_generation_ends_reports_the_parked_session(serve, monkeypatch, resting):
    server = serve("qwen3", kv_resting_sessions=resting)
    slow = 0.3  # a park as slow as a long history's (it packs the held coordinates again), so a reply can race it
    park, rest = PackedLayerStore.park, PackedLayerStore.rest

    def slow_park(self, slots):
        time.sleep(slow / 4)  # four layers
        park(self, slots)

    def slow_rest(self, slots):
        time.sleep(slow / 4)
        return rest(self, slots)

    monkeypatch.setattr(PackedLayerStore, "park", slow_park)
    monkeypatch.setattr(PackedLayerStore, "rest", slow_rest)
    with kakeya.Client(server.address) as client:
        session = client.create_session(initial_tokens=PROMPT, kv_compressor="kakeya_d4")
        for _ in range(2):  # the second generation begins from the packed codes the first park wrote
            assert len(list(session.generate(max_tokens=5))) == 5  # the SDK returns at GenerateDone
            described = session.info()
            assert not described.generating
            kv = described.kv_live_bytes - described.draft_state_bytes  # the proposer's state is reported apart
            assert described.kv_compressed_bytes < kv < described.kv_compressed_bytes + 4096
            assert described.kv_peak_bytes > described.kv_live_bytes


def test_the_session_that_generated_last_rests_on_its_coordinates_until_another_generates(serve):
    servers = serve("qwen3"), serve("qwen3", kv_resting_sessions=0)  # the default (1), and every session packing
    first = [create(server.stub, initial=PROMPT, kv_compressor=pb.KV_COMPRESSOR_KAKEYA_D4) for server in servers]
    tokens = [list(generate(server.stub, sid, max_tokens=6).tokens) for server, sid in zip(servers, first, strict=True)]
    rested, parked = (info(server.stub, sid) for server, sid in zip(servers, first, strict=True))
    # Resting, it holds int8 coordinates and fp16 scales (head_dim 16: 20 bytes per vector, packed 17) and nothing
    # else: no stage, no room. Its next generation starts from them, with the tokens of a session that packed.
    assert rested.kv_compressed_bytes == pytest.approx(parked.kv_compressed_bytes * 20 / 17, rel=0.02)
    kv = rested.kv_live_bytes - rested.draft_state_bytes  # the proposer's state is reported apart
    assert rested.kv_compressed_bytes < kv < rested.kv_compressed_bytes + 4096
    assert rested.kv_dense_equivalent_bytes == parked.kv_dense_equivalent_bytes
    for index, (server, sid) in enumerate(zip(servers, first, strict=True)):
        tokens[index] += generate(server.stub, sid, max_tokens=6).tokens
    assert tokens[0] == tokens[1]
    # Another session generates: the one that rested parks, and holds the codes of the session that packed.
    resting, packing = servers
    other = create(resting.stub, initial=[token + 1 for token in PROMPT], kv_compressor=pb.KV_COMPRESSOR_KAKEYA_D4)
    generate(resting.stub, other, max_tokens=2)
    now, packed, last = info(resting.stub, first[0]), info(packing.stub, first[1]), info(resting.stub, other)
    assert now.kv_compressed_bytes == packed.kv_compressed_bytes
    per_dense = last.kv_compressed_bytes / last.kv_dense_equivalent_bytes  # the one resting now
    assert per_dense == pytest.approx(now.kv_compressed_bytes / now.kv_dense_equivalent_bytes * 20 / 17, rel=0.02)
    assert now.kv_escaped_blocks == packed.kv_escaped_blocks


def test_the_server_default_compressor_applies_to_new_sessions_and_the_sdk_can_override_it(serve):
    server = serve("qwen3", kv_compressor="kakeya_e8", kv_q_range=10)
    with kakeya.Client(server.address) as client:
        default = client.create_session(initial_tokens=PROMPT)
        assert len(list(default.generate(max_tokens=4))) == 4
        overridden = client.create_session(initial_tokens=PROMPT, kv_compressor="none")
        assert len(list(overridden.generate(max_tokens=4))) == 4
        described = default.info()
        assert described.kv_compressor is kakeya.KvCompressor.KAKEYA_E8 and described.kv_q_range == 10
        assert described.kv_compressed_bytes > 0
        assert overridden.info().kv_compressor is kakeya.KvCompressor.NONE
        with pytest.raises(kakeya.InvalidArgument):
            client.create_session(kv_compressor="kakeya_z8")


def test_a_one_scale_session_holds_two_bytes_fewer_per_vector_and_reports_its_compressor(serve):
    server = serve("qwen3", kv_resting_sessions=0)  # each session packs when it parks
    with kakeya.Client(server.address) as client:
        held = {}
        for name in ("kakeya_d4", "kakeya_d4s"):
            session = client.create_session(initial_tokens=PROMPT, kv_compressor=name, kv_q_range=38)
            assert len(list(session.generate(max_tokens=6))) == 6
            described = session.info()
            assert described.kv_compressor is kakeya.KvCompressor(name) and described.kv_q_range == 38
            held[name] = described
    # head_dim 16 at Q=38: 13 bytes of D4 codes per vector, then an fp16 norm and scale (17) or the scale (15).
    one, two = held["kakeya_d4s"], held["kakeya_d4"]
    assert one.kv_dense_equivalent_bytes == two.kv_dense_equivalent_bytes
    assert one.kv_compressed_bytes / two.kv_compressed_bytes == pytest.approx(15 / 17, rel=0.01)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_compressor": pb.KV_COMPRESSOR_KAKEYA_E8, "kv_q_range": 117}, "q_range"),
        ({"kv_compressor": pb.KV_COMPRESSOR_KAKEYA_D4, "kv_q_range": 0}, "q_range"),
        ({"kv_compressor": pb.KV_COMPRESSOR_NONE, "kv_q_range": 10}, "does not apply"),
        ({"kv_compressor": 9}, "unknown kv_compressor"),
    ],
)
def test_bad_compressor_choices_are_invalid_arguments_and_leave_other_sessions_intact(serve, fields, message):
    server = serve("qwen3")
    sid = create(server.stub, initial=PROMPT, kv_compressor=pb.KV_COMPRESSOR_KAKEYA_D4)
    with pytest.raises(grpc.RpcError) as error:
        create(server.stub, initial=PROMPT, **fields)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (error.value.details() or "")
    assert len(generate(server.stub, sid, max_tokens=3).tokens) == 3


def test_a_byte_budget_holds_more_compressed_sessions(serve):
    def sessions_held(compressor: str, budget: int) -> int:
        server = serve("qwen3", kv_compressor=compressor, kv_budget_bytes=budget)
        ids = []
        for k in range(10):
            # Histories of one length that differ from their first token: none starts from another's K/V, whose
            # first generation would grow its room as a later generation does, beyond what the probe measured.
            sid = create(server.stub, initial=[token + k for token in PROMPT])
            generate(server.stub, sid, max_tokens=2)
            ids.append(sid)
        return int(_value(server.metrics_text(), "kakeya_session_active"))

    probe = serve("qwen3")
    sid = create(probe.stub, initial=PROMPT)
    generate(probe.stub, sid, max_tokens=2)
    one_dense = info(probe.stub, sid)
    packed_sid = create(probe.stub, initial=PROMPT, kv_compressor=pb.KV_COMPRESSOR_KAKEYA_D4, kv_q_range=38)
    generate(probe.stub, packed_sid, max_tokens=2)
    # The budget charges a generating session all it holds: room for one generating session of either kind, then
    # two and a half parked dense sessions.
    generating = max(one_dense.kv_peak_bytes, info(probe.stub, packed_sid).kv_peak_bytes)
    budget = generating + 2 * one_dense.kv_live_bytes + one_dense.kv_live_bytes // 2
    dense, packed = sessions_held("none", budget), sessions_held("kakeya_d4", budget)
    assert dense >= 3
    assert packed >= 2 * dense  # fp32 head_dim 16: 64 dense bytes per vector against 13 + 4 packed


def test_the_compressor_flags_are_validated_at_start():
    config = load_config({"kv_compressor": "kakeya_d4", "kv_q_range": 10}, environ={})
    assert config.compressor().spec(64).bits_per_vector == 16 * 17 + 32
    with pytest.raises(ConfigError, match="q_range"):
        load_config({"kv_compressor": "kakeya_e8", "kv_q_range": 200}, environ={})
    with pytest.raises(ConfigError, match="kv_compressor"):
        load_config({"kv_compressor": "zstd"}, environ={})


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_compressed_restoring_session_holds_its_restored_kv_coded_where_attention_reads_coordinates(serve, backend):
    server = serve("qwen3", kv_strategy="dlm_restore", sink=2, window=8)
    prompt = list(range(5, 85))  # 70 positions evicted before the first generation
    dense = create(server.stub, initial=prompt)
    packed = create(server.stub, initial=prompt, kv_compressor=pb.KV_COMPRESSOR_KAKEYA_D4)
    tokens = {sid: generate(server.stub, sid, max_tokens=4).tokens for sid in (dense, packed)}
    dense_info, packed_info = info(server.stub, dense), info(server.stub, packed)
    assert all(len(generated) == 4 for generated in tokens.values())
    assert dense_info.kv_peak_restored_bytes > 0 and packed_info.kv_restored_bytes == 0  # parked: none held
    if backend == "torch":  # about a quarter of the dense bytes (int8 coordinates, fp16 norms and scales)
        assert packed_info.kv_peak_restored_bytes * 3 < dense_info.kv_peak_restored_bytes
    else:  # MLX attention reads dense K/V only
        assert packed_info.kv_peak_restored_bytes == dense_info.kv_peak_restored_bytes
