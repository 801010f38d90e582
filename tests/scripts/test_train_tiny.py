"""scripts/train_tiny.py --quick end to end, and its result served through the real daemon path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import grpc
import pytest

from inference_engine.generated import runtime_pb2 as pb
from inference_engine.generated import runtime_pb2_grpc
from tests.support.children import run_child
from tests.support.daemon import Daemon

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def test_quick_training_produces_a_family_the_daemon_serves_with_its_drafter(tmp_path):
    out, work, results = tmp_path / "kakeya-tiny", tmp_path / "work", tmp_path / "results"
    command = [
        sys.executable,
        "scripts/train_tiny.py",
        "--quick",
        "--out",
        str(out),
        "--work",
        str(work),
        "--results-dir",
        str(results),
    ]
    result = run_child(command, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    card = json.loads((out / "kakeya_model.json").read_text())
    assert card["architecture"] == "Qwen3ForCausalLM" and card["corpus"]["train_tokens"] > 0
    config = json.loads((out / "config.json").read_text())
    assert config["head_dim"] == 64 and config["dtype"] == "bfloat16"
    assert json.loads((out / "dflash" / "config.json").read_text())["dflash_config"]["mask_token_id"] >= 0
    assert (out / "tokenizer.json").is_file() and list(results.glob("train_tiny_*.json"))

    daemon = Daemon(
        "serve",
        "--model",
        str(out),
        "--proposer",
        "dflash",
        "--draft-model",
        str(out / "dflash"),
        "--port",
        "0",
        "--metrics-port",
        "-1",
    )
    try:
        host, port = daemon.wait_listening()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
        prompt = tokenizer.encode("def main():\n    return")
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
            sid = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=prompt)).session_id
            replies = list(stub.Generate(pb.GenerateRequest(session_id=sid, max_tokens=12)))
        done = replies[-1].done
        assert done.generated_token_count == 12 and done.draft_token_count > 0
    finally:
        daemon.terminate()
        assert daemon.wait() == 0
