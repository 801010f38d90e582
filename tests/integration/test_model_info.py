"""GetModelInfo reports the served model's facts and the server's limits; sessions created without
`eos_token_ids` stop on the model's end-of-sequence ids unless they opt out."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from inference_engine import __version__
from inference_engine.config import BUNDLED_MODEL_DIR
from inference_engine.generated import runtime_pb2 as pb
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from tests.support.checkpoints import copy_with_eos
from tests.support.server import create, generate, start_server

PROMPT = [5, 17, 42, 9, 63, 2, 88]


@pytest.fixture(scope="module")
def bundled_server():
    server = start_server(
        TorchVerifier.load(BUNDLED_MODEL_DIR, device="cpu", dtype="float32"),
        max_generate_tokens=512,
        kv_strategy="sink_window",
        sink=8,
        window=256,
    )
    yield server
    server.stop()


def test_model_info_reports_the_bundled_models_facts_and_the_server_limits(bundled_server):
    info = bundled_server.stub.GetModelInfo(pb.GetModelInfoRequest())
    generation_config = json.loads((BUNDLED_MODEL_DIR / "generation_config.json").read_text())
    config = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())
    assert info.vocab_size == config["vocab_size"] == 4096
    assert list(info.eos_token_ids) == generation_config["eos_token_id"]
    assert info.trained_context_tokens == config["max_position_embeddings"]
    assert info.chat_template == (BUNDLED_MODEL_DIR / "chat_template.jinja").read_text()
    assert info.backend == "torch" and info.model_name == "kakeya-tiny" and info.proposer == "ngram"
    assert info.description.startswith("torch ")
    assert info.server_version == __version__
    assert info.default_kv_strategy == pb.KV_STRATEGY_SINK_WINDOW
    assert (info.default_sink_tokens, info.default_window_tokens) == (8, 256)
    limits = bundled_server.runtime.config
    assert info.limits.max_generate_tokens == 512
    assert info.limits.max_append_tokens == limits.max_append_tokens
    assert info.limits.max_history_tokens == limits.max_history_tokens
    assert info.limits.max_sessions == limits.max_sessions
    assert info.limits.max_message_bytes == limits.max_message_bytes
    assert info.limits.max_concurrent_generations == limits.max_concurrent
    assert info.limits.queue_deadline_seconds == limits.queue_deadline_s
    # 0 (the default): the backend's, 16 on torch
    assert limits.max_batch_size == 0 and info.limits.max_batch_size == 16
    # --prefill-chunk-tokens 0 (the default) chooses from the device: 512 on a CPU.
    assert limits.prefill_chunk_tokens == 0 and info.limits.prefill_chunk_tokens == 512


@pytest.mark.parametrize("backend", ["mlx"])
def test_an_mlx_daemon_batches_sixteen_steps_unless_told_otherwise(serve):
    """Its batched rows are attended row by row (the model's attention routed), so it batches as torch does."""
    default, chosen = serve("qwen3", max_concurrent=4), serve("qwen3", max_concurrent=4, max_batch_size=1)
    assert default.runtime.verifier.rows_routed
    for server, size in ((default, 16), (chosen, 1)):
        info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
        assert info.limits.max_batch_size == size and server.runtime.engine.max_batch_size == size


def test_an_explicit_prefill_chunk_is_the_one_used_and_reported(serve):
    server = serve("qwen3", prefill_chunk_tokens=24, max_batch_size=3)
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.limits.prefill_chunk_tokens, info.limits.max_batch_size) == (24, 3)
    assert server.runtime.decoder.prefill_chunk_tokens == 24
    sid = create(server.stub, list(range(3, 60)))
    done = generate(server.stub, sid, max_tokens=2).done
    assert done is not None and done.verifier_forward_count == 4, "57 pending tokens: two chunks of 24, then two steps"


def test_model_info_of_a_model_without_chat_template_or_eos_leaves_them_unset(serve):
    server = serve("qwen3")
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.vocab_size == 128
    assert list(info.eos_token_ids) == []
    assert not info.HasField("chat_template")
    assert info.trained_context_tokens == 4096


@pytest.fixture
def eos_model(verifier_pool, tmp_path: Path):
    """The random qwen3 checkpoint, copied with the third greedily generated token of PROMPT as its EOS id."""
    verifier = verifier_pool.get("torch", "qwen3")
    source = verifier_pool.model_dir("torch", "qwen3")
    probe = start_server(verifier, model_dir=source)
    try:
        stream = generate(probe.stub, create(probe.stub, initial=PROMPT), max_tokens=12).tokens
    finally:
        probe.stop()
    eos = stream[2]
    assert eos not in stream[:2], "the prompt must reach the EOS id only at the third token"
    server = start_server(verifier, model_dir=copy_with_eos(source, tmp_path / "qwen3-eos", [eos]))
    yield server, stream
    server.stop()


def test_a_session_without_eos_ids_stops_on_the_models_eos(eos_model):
    server, stream = eos_model
    assert list(server.stub.GetModelInfo(pb.GetModelInfoRequest()).eos_token_ids) == [stream[2]]
    result = generate(server.stub, create(server.stub, initial=PROMPT), max_tokens=12)
    assert result.tokens == stream[:3]
    assert result.done is not None and result.done.stop_reason == pb.STOP_REASON_EOS


def test_no_default_eos_gives_a_session_no_eos_ids(eos_model):
    server, stream = eos_model
    result = generate(server.stub, create(server.stub, initial=PROMPT, no_default_eos=True), max_tokens=12)
    assert result.tokens == stream
    assert result.done is not None and result.done.stop_reason == pb.STOP_REASON_MAX_TOKENS


def test_explicit_eos_ids_replace_the_models(eos_model):
    server, stream = eos_model
    own = stream[5]
    result = generate(server.stub, create(server.stub, initial=PROMPT, eos_token_ids=[own]), max_tokens=12)
    assert result.tokens == stream[: stream.index(own) + 1]
    assert result.done is not None and result.done.stop_reason == pb.STOP_REASON_EOS


def test_model_info_needs_the_api_key_when_one_is_set(serve):
    server = serve("qwen3", api_key="s3cret")
    with pytest.raises(grpc.RpcError) as missing:
        server.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=[("authorization", "Bearer s3cret")])
    assert info.vocab_size == 128
