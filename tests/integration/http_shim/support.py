"""Helpers of the HTTP shim tests: an OpenAI client for a running daemon, metric reads, the gRPC reference path."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import openai

from inference_engine.config import BUNDLED_MODEL_DIR
from inference_engine.generated import runtime_pb2 as pb
from tests.support.server import Generation, RunningServer, create, generate

MODEL = "kakeya-tiny"


def _end_ids() -> list[int]:
    """The bundled model's end-of-sequence ids as a client reads them: the tokenizer's and generation_config.json's."""
    tokenizer = json.loads((BUNDLED_MODEL_DIR / "tokenizer_config.json").read_text())
    vocab = json.loads((BUNDLED_MODEL_DIR / "tokenizer.json").read_text())["added_tokens"]
    ids = {token["id"] for token in vocab if token["content"] == tokenizer["eos_token"]}
    generation = json.loads((BUNDLED_MODEL_DIR / "generation_config.json").read_text()).get("eos_token_id", [])
    return sorted(ids | set(generation if isinstance(generation, list) else [generation]))


EOS_IDS = _end_ids()
DEPRECATION_HEADERS = ("deprecation", "sunset", "link")


def client(server: RunningServer, api_key: str = "unused", **kwargs: Any) -> openai.OpenAI:
    """The official client pointed at the shim; no retries, so every refusal is seen as sent."""
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key=api_key, max_retries=0, timeout=120, **kwargs)


def metric(server: RunningServer, sample: str, api_key: str | None = None) -> float:
    """One sample of the daemon's Prometheus registry, read from the shim's own /metrics."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(server.http_url + "/metrics", headers=headers, timeout=30).text
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    assert match, f"{sample} not exported"
    return float(match.group(1))


def wait_until_no_session(server: RunningServer, timeout_s: float = 60.0, api_key: str | None = None) -> None:
    """Wait until the daemon holds no session (the kakeya_session_active gauge is back to zero)."""
    deadline = time.monotonic() + timeout_s
    while metric(server, "kakeya_session_active", api_key) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "kakeya_session_active", api_key) == 0, "a session was left behind"
    assert len(server.runtime.store) == 0


def assert_deprecated(headers: Mapping[str, str]) -> None:
    """The deprecation headers every shim response carries."""
    assert re.fullmatch(r"@\d+", headers["deprecation"]), headers["deprecation"]
    assert re.fullmatch(r"\w{3}, \d{2} \w{3} \d{4} \d{2}:\d{2}:\d{2} GMT", headers["sunset"]), headers["sunset"]
    assert '</docs/migration-from-openai.md>; rel="deprecation"' in headers["link"]


def grpc_generation(server: RunningServer, prompt: Sequence[int], eos: Sequence[int], **params: Any) -> Generation:
    """The same generation over the gRPC path: a session given `prompt`, generated with `params`, then closed."""
    sid = create(server.stub, eos_token_ids=list(eos))
    server.stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=list(prompt)))
    result = generate(server.stub, sid, **params)
    server.stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    return result
