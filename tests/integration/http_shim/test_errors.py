"""Every refusal of the shim: the HTTP status, the OpenAI error envelope naming the field, the deprecation headers,
and no session left behind."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from inference_engine.config import BUNDLED_MODEL_DIR
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from tests.integration.http_shim.support import MODEL, assert_deprecated, client, wait_until_no_session
from tests.support.server import RunningServer, start_server

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

MESSAGES = [{"role": "user", "content": "Hello"}]
LIMITS = {"max_generate_tokens": 64, "max_append_tokens": 256, "max_message_bytes": 16384}


@pytest.fixture(scope="module")
def limited(tiny_verifier: TorchVerifier) -> Iterator[RunningServer]:
    """A shim with small limits, so that each can be crossed cheaply."""
    server = start_server(tiny_verifier, http_port=0, **LIMITS)
    yield server
    server.stop()


def _refusal(exc: openai.APIStatusError, status: int, param: str | None, code: str) -> dict[str, Any]:
    assert exc.status_code == status, exc.body
    assert_deprecated(exc.response.headers)
    envelope = exc.response.json()
    assert set(envelope) == {"error"}
    error = envelope["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    assert (error["param"], error["code"]) == (param, code), error
    return error


CHAT_REFUSALS: list[tuple[dict[str, Any], str | None, str]] = [
    ({"n": 2}, "n", "unsupported_parameter"),
    ({"n": 0}, "n", "unsupported_parameter"),
    ({"logprobs": True}, "logprobs", "unsupported_parameter"),
    ({"top_logprobs": 2}, "top_logprobs", "unsupported_parameter"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
        "tools",
        "unsupported_parameter",
    ),
    ({"tool_choice": "auto"}, "tool_choice", "unsupported_parameter"),
    ({"response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
    ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
    ({"frequency_penalty": -1.0}, "frequency_penalty", "unsupported_parameter"),
    ({"logit_bias": {"5": 10}}, "logit_bias", "unsupported_parameter"),
    ({"extra_body": {"modalities": ["audio"]}}, "modalities", "unsupported_parameter"),
    ({"extra_body": {"guided_json": {}}}, "guided_json", "unsupported_parameter"),
    ({"temperature": 2.5}, "temperature", "invalid_value"),
    ({"temperature": -0.1}, "temperature", "invalid_value"),
    ({"top_p": 0.0}, "top_p", "invalid_value"),
    ({"top_p": 1.5}, "top_p", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_tokens": 65}, "max_tokens", "invalid_value"),
    ({"max_completion_tokens": 100}, "max_completion_tokens", "invalid_value"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens", "invalid_value"),
    ({"seed": -1}, "seed", "invalid_value"),
    ({"stop": [""]}, "stop", "invalid_value"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"stop": [1]}, "stop[0]", "invalid_value"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x", "unsupported_parameter"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name", "unsupported_parameter"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
        "messages[0].content[0].type",
        "invalid_value",
    ),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_value"),
    # the tokenizer splits digits one per token: 300 of them exceed max_append_tokens whatever else is merged
    ({"messages": [{"role": "user", "content": "7" * 300}]}, "messages", "context_length_exceeded"),
]


@pytest.mark.parametrize(("overrides", "param", "code"), CHAT_REFUSALS, ids=[f"{p}-{c}" for _, p, c in CHAT_REFUSALS])
def test_an_invalid_or_unsupported_chat_request_is_refused_with_400(limited, overrides, param, code):
    kwargs: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, **overrides}
    with pytest.raises(openai.BadRequestError) as caught:
        client(limited).chat.completions.create(**kwargs)
    _refusal(caught.value, 400, param, code)
    wait_until_no_session(limited)


COMPLETION_REFUSALS: list[tuple[dict[str, Any], str | None, str]] = [
    ({"prompt": ["one", "two"]}, "prompt", "unsupported_parameter"),
    ({"echo": True}, "echo", "unsupported_parameter"),
    ({"best_of": 2}, "best_of", "unsupported_parameter"),
    ({"suffix": "end"}, "suffix", "unsupported_parameter"),
    ({"logprobs": 1}, "logprobs", "unsupported_parameter"),
    ({"n": 3}, "n", "unsupported_parameter"),
    ({"prompt": ""}, None, "invalid_value"),
    ({"prompt": [5, 100000]}, None, "invalid_value"),  # outside the vocabulary: refused by the session itself
    ({"prompt": [5, 100000], "stream": True}, None, "invalid_value"),  # before the first token: still an HTTP 400
]


@pytest.mark.parametrize(
    ("overrides", "param", "code"),
    COMPLETION_REFUSALS,
    ids=[f"{i}-{p}-{c}" for i, (_, p, c) in enumerate(COMPLETION_REFUSALS)],
)
def test_an_invalid_or_unsupported_completion_request_is_refused_with_400(limited, overrides, param, code):
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "Hello", **overrides}
    with pytest.raises(openai.BadRequestError) as caught:
        client(limited).completions.create(**kwargs)
    _refusal(caught.value, 400, param, code)
    wait_until_no_session(limited)


def test_an_unknown_model_is_404_model_not_found(limited):
    with pytest.raises(openai.NotFoundError) as caught:
        client(limited).chat.completions.create(model="gpt-4o", messages=MESSAGES)
    error = _refusal(caught.value, 404, "model", "model_not_found")
    assert MODEL in error["message"]
    with pytest.raises(openai.NotFoundError):
        client(limited).models.retrieve("gpt-4o")


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "invalid_json"),
        (b"[1, 2]", "invalid_json"),
        (
            b'{"model": "kakeya-tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}',
            "invalid_value",
        ),
        (b'{"model": "kakeya-tiny", "messages": [{"role": "user", "content": "x"}], "stream": 1}', "invalid_value"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "missing_required_parameter"),
    ],
)
def test_malformed_bodies_are_refused_in_the_envelope(limited, body, code):
    reply = httpx.post(
        limited.http_url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == code
    assert_deprecated(reply.headers)


def test_a_body_over_the_message_limit_is_413(limited):
    body = b'{"model": "kakeya-tiny", "prompt": "' + b"x" * LIMITS["max_message_bytes"] + b'"}'
    reply = httpx.post(limited.http_url + "/v1/completions", content=body)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "too_large"
    assert_deprecated(reply.headers)


def test_unknown_paths_and_methods_get_the_envelope_too(limited):
    missing = httpx.get(limited.http_url + "/v1/embeddings")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert_deprecated(missing.headers)
    wrong = httpx.get(limited.http_url + "/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert_deprecated(wrong.headers)


def test_a_wrong_or_missing_api_key_is_401_and_the_right_one_works(serve_shim):
    server = serve_shim(api_key="s3cret")
    with pytest.raises(openai.AuthenticationError) as caught:
        client(server, api_key="wrong").chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    _refusal(caught.value, 401, None, "invalid_api_key")
    assert caught.value.response.headers["www-authenticate"] == "Bearer"
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(server.http_url + path).status_code == 401
    assert httpx.get(server.http_url + "/healthz").status_code == 200  # health stays open, as on gRPC
    reply = client(server, api_key="s3cret").chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    # the random test model's first greedy token can be its EOS; the key is accepted either way
    assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 2
    assert reply.choices[0].finish_reason in ("length", "stop")
    wait_until_no_session(server, api_key="s3cret")


def test_a_model_without_a_tokenizer_refuses_text_with_400(serve_shim, verifiers, checkpoints):
    server = serve_shim(verifiers["qwen3"], model=str(checkpoints["qwen3"]))
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).chat.completions.create(model="qwen3", messages=MESSAGES)
    error = _refusal(caught.value, 400, None, "tokenizer_unavailable")
    assert "no tokenizer" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).completions.create(model="qwen3", prompt=[1, 2, 3], max_tokens=2)
    _refusal(caught.value, 400, None, "tokenizer_unavailable")
    wait_until_no_session(server)


def test_a_tokenizer_without_a_chat_template_refuses_chat_only(serve_shim, tiny_verifier, tmp_path):
    model_dir = tmp_path / "kakeya-tiny"
    shutil.copytree(BUNDLED_MODEL_DIR, model_dir)
    (model_dir / "chat_template.jinja").unlink()
    server = serve_shim(tiny_verifier, model=str(model_dir))
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).chat.completions.create(model=MODEL, messages=MESSAGES)
    error = _refusal(caught.value, 400, None, "tokenizer_unavailable")
    assert "no chat template" in error["message"]
    reply = client(server).completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    wait_until_no_session(server)


def _self_signed(directory: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate and is not installed")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_with_tls_configured_the_shim_serves_https_with_the_same_certificate(serve_shim, tmp_path):
    cert, key = _self_signed(tmp_path)
    server = serve_shim(tls_cert=str(cert), tls_key=str(key))
    url = server.http_url.replace("http://", "https://")
    with pytest.raises(httpx.TransportError):
        httpx.get(server.http_url + "/healthz")  # plaintext is not served
    api = openai.OpenAI(
        base_url=url + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(verify=ssl.create_default_context(cafile=str(cert))),
    )
    reply = api.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens == 2
