"""A GGUF file served directly by both backends: one conversion, reused by the next start whatever its backend,
and the same greedy tokens from either."""

from __future__ import annotations

import grpc

from inference_engine.generated import runtime_pb2 as pb
from inference_engine.generated import runtime_pb2_grpc
from tests.support.daemon import Daemon
from tests.support.gguf_files import write_gguf

PROMPT = [5, 17, 33, 2, 90, 41, 7, 64]


def _serve_and_generate(gguf_file, cache, backend: str) -> tuple[list[int], str]:
    daemon = Daemon(
        "serve", "--model", str(gguf_file), "--model-cache-dir", str(cache), "--backend", backend,
        "--device", "cpu", "--port", "0", "--metrics-port", "-1",
    )  # fmt: skip
    try:
        host, port = daemon.wait_listening()
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
            session = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=PROMPT, no_default_eos=True))
            replies = stub.Generate(pb.GenerateRequest(session_id=session.session_id, max_tokens=12))
            tokens = [r.token_id for r in replies if r.WhichOneof("payload") == "token_id"]
    finally:
        daemon.kill()
    return tokens, daemon.output


def test_both_backends_serve_a_gguf_file_from_one_conversion_with_the_same_tokens(checkpoints, tmp_path):
    gguf_file = write_gguf(checkpoints["qwen3"], tmp_path / "qwen3-f32.gguf", "F32")
    cache = tmp_path / "cache"
    torch_tokens, torch_log = _serve_and_generate(gguf_file, cache, "torch")
    mlx_tokens, mlx_log = _serve_and_generate(gguf_file, cache, "mlx")
    assert "converting GGUF file into the model cache" in torch_log
    assert "model cache reused" in mlx_log and "converting GGUF file" not in mlx_log
    assert len(torch_tokens) == 12
    assert mlx_tokens == torch_tokens
