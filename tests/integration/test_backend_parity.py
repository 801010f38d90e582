"""The same weights served with `--backend torch` and `--backend mlx` (fp32): identical greedy streams, logits
within the documented tolerance, the same sampled token from the same logits, the same KV byte accounting."""

from __future__ import annotations

import json
import random

import grpc
import mlx.core as mx
import numpy as np
import pytest
import torch

from inference_engine.config import BUNDLED_MODEL_DIR
from inference_engine.generated import runtime_pb2_grpc
from kv_cache_proposer.backends import load_verifier
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy, SinkWindowStrategy
from tests.support.backends import to_numpy
from tests.support.checkpoints import VOCAB_SIZE
from tests.support.daemon import Daemon
from tests.support.server import create, generate, start_server

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

PROMPT_COUNT = 20
NEW_TOKENS = 16
# docs/backends.md: fp32 forwards of the two frameworks differ only by summation order; the largest difference
# measured on these models is 1.1e-5 (Qwen3, |logit| <= 7), so the bound keeps a tenfold margin.
LOGITS_ATOL = LOGITS_RTOL = 1e-4


def _prompts() -> list[list[int]]:
    """A fixed set of prompts of varied lengths."""
    prompts = []
    for i in range(PROMPT_COUNT):
        rng = random.Random(100 + i)
        prompts.append([rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(4, 64))])
    return prompts


def _served_streams_for(verifier, model_dir, prompts: list[list[int]]) -> list[list[int]]:
    server = start_server(verifier, model_dir=model_dir, prefill_chunk_tokens=16)
    try:
        return [generate(server.stub, create(server.stub, initial=p), max_tokens=NEW_TOKENS).tokens for p in prompts]
    finally:
        server.stop()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_streams_and_logits_agree_across_backends(verifier_pool, arch):
    torch_verifier, mlx_verifier = verifier_pool.get("torch", arch), verifier_pool.get("mlx", arch)
    torch_streams = _served_streams_for(torch_verifier, verifier_pool.model_dir("torch", arch), _prompts())
    mlx_streams = _served_streams_for(mlx_verifier, verifier_pool.model_dir("mlx", arch), _prompts())
    assert all(len(stream) == NEW_TOKENS for stream in torch_streams)
    assert len({tuple(s) for s in torch_streams}) == PROMPT_COUNT, "the prompts must lead to different streams"
    for i, (expected, served) in enumerate(zip(torch_streams, mlx_streams, strict=True)):
        assert served == expected, f"prompt {i} diverged"
    for prompt, stream in zip(_prompts(), torch_streams, strict=True):
        sequence = prompt + stream
        logits = []
        for verifier in (torch_verifier, mlx_verifier):
            cache = verifier.new_cache(FullStrategy())
            logits.append(to_numpy(verifier.verify(cache, sequence, len(sequence)).logits))  # [T, V]
        np.testing.assert_allclose(logits[1], logits[0], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_the_same_logits_seed_and_position_sample_the_same_token_on_both_backends(verifier_pool):
    torch_verifier, mlx_verifier = verifier_pool.get("torch", "qwen3"), verifier_pool.get("mlx", "qwen3")
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=3.0, size=(64, VOCAB_SIZE)).astype(np.float32)
    logits[:, 7] = logits[:, 9] = logits.max(axis=-1)  # ties at the top must break the same way
    positions = list(range(1000, 1064))
    for params in (
        SamplingParams(),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=1.3, top_k=5, seed=4),
        SamplingParams(temperature=1.0, top_p=0.8, seed=5),
    ):
        from_torch = torch_verifier.pick_tokens(torch.from_numpy(logits), params, positions)
        from_mlx = mlx_verifier.pick_tokens(mx.array(logits), params, positions)
        assert from_mlx == from_torch
        assert len(set(from_torch)) > 1


def test_kv_byte_accounting_and_evictions_are_the_same_on_both_backends(verifier_pool):
    """kv_live_bytes, and therefore the KV budget's evictions, do not depend on the backend."""
    verifiers = (verifier_pool.get("torch", "gemma3"), verifier_pool.get("mlx", "gemma3"))
    for strategy in (FullStrategy(), SinkWindowStrategy(sink=2, window=8)):
        caches = [verifier.new_cache(strategy) for verifier in verifiers]
        for size in (5, 1, 300, 3):
            for verifier, cache in zip(verifiers, caches, strict=True):
                verifier.verify(cache, [size % VOCAB_SIZE] * size, 1)
                verifier.commit(cache, size)
            assert caches[0].nbytes == caches[1].nbytes > 0
            assert caches[0].evicted_count == caches[1].evicted_count
            assert caches[0].resident_count == caches[1].resident_count


def test_the_console_script_serves_the_bundled_model_with_backend_mlx():
    prompt = list(b"Hello, Kakeya")
    expected = _served_streams_for(
        load_verifier("torch", BUNDLED_MODEL_DIR, device="cpu", dtype="float32"), BUNDLED_MODEL_DIR, [prompt]
    )
    daemon = Daemon(
        "serve", "--backend", "mlx", "--device", "cpu", "--dtype", "float32", "--port", "0", "--metrics-port", "-1"
    )
    try:
        host, port = daemon.wait_listening()
        layers = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())["num_hidden_layers"]
        assert f"mlx qwen3 ({layers} layers) on cpu float32" in daemon.output
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
            served = generate(stub, create(stub, initial=prompt), max_tokens=NEW_TOKENS).tokens
        assert served == expected[0]
    finally:
        daemon.kill()


def test_backend_mlx_refuses_a_torch_device_name(verifier_pool):
    model_dir = verifier_pool.model_dir("mlx", "llama")
    daemon = Daemon("serve", "--backend", "mlx", "--model", str(model_dir), "--device", "cuda", "--port", "0")
    assert daemon.wait(timeout_s=120) == 1
    assert "unknown device 'cuda' for the mlx backend" in daemon.output
