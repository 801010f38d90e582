"""The official `openai` client against the live shim: the text, finish reason and usage it gets are exactly what the
gRPC path generates for the same rendered tokens and seed, streaming or not."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from inference_engine.generated import runtime_pb2 as pb
from tests.integration.http_shim.support import (
    EOS_IDS,
    MODEL,
    assert_deprecated,
    client,
    grpc_generation,
    metric,
    wait_until_no_session,
)
from tests.support.server import Generation

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

MESSAGES = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Name three colours, please."},
]
# float32-exact values, so the gRPC request (float fields) and the JSON request sample identically
SAMPLED = {"temperature": 0.75, "top_p": 0.875, "seed": 1234}
GREEDY = {"temperature": 0.0}


def _rendered(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def _expected_text(tokenizer: Any, result: Generation) -> str:
    return tokenizer.decode([t for t in result.tokens if t not in EOS_IDS], skip_special_tokens=True)


def _expected_finish(result: Generation) -> str:
    assert result.done is not None
    return "stop" if result.done.stop_reason == pb.STOP_REASON_EOS else "length"


def _stream_chat(shim: Any, **kwargs: Any) -> tuple[str, list[Any]]:
    kwargs.setdefault("model", MODEL)
    chunks = list(client(shim).chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_chat_completion_equals_the_grpc_generation_of_the_rendered_tokens(shim, tiny_tokenizer, sampling):
    prompt = _rendered(tiny_tokenizer, MESSAGES)
    reference = grpc_generation(shim, prompt, EOS_IDS, max_tokens=24, **sampling)

    reply = client(shim).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, **sampling)

    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == _expected_text(tiny_tokenizer, reference)
    assert choice.finish_reason == _expected_finish(reference)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(reference.tokens)
    assert reply.usage.total_tokens == len(prompt) + len(reference.tokens)
    assert reply.model == MODEL and reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    wait_until_no_session(shim)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_streamed_chat_equals_the_grpc_generation_and_reports_usage_last(shim, tiny_tokenizer, sampling):
    prompt = _rendered(tiny_tokenizer, MESSAGES)
    reference = grpc_generation(shim, prompt, EOS_IDS, max_tokens=24, **sampling)

    text, chunks = _stream_chat(
        shim, messages=MESSAGES, max_tokens=24, stream_options={"include_usage": True}, **sampling
    )

    assert text == _expected_text(tiny_tokenizer, reference)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, finish, usage = chunks
    assert all(c.choices[0].finish_reason is None and c.usage is None for c in body)
    assert finish.choices[0].finish_reason == _expected_finish(reference)
    assert usage.choices == [] and usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (len(prompt), len(reference.tokens))
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    wait_until_no_session(shim)


def test_a_stream_without_include_usage_has_no_usage_chunk(shim):
    text, chunks = _stream_chat(shim, messages=MESSAGES, max_tokens=8, temperature=0)
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    reply = client(shim).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert text == reply.choices[0].message.content


def test_the_raw_event_stream_ends_with_done_and_carries_the_deprecation_headers(shim):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", shim.http_url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert_deprecated(response.headers)
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    assert events.count("data: [DONE]") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_text_completion_equals_the_grpc_generation_of_the_encoded_prompt(shim, tiny_tokenizer, stream):
    prompt_text = "Once upon a time"
    prompt = tiny_tokenizer.encode(prompt_text, add_special_tokens=True)
    reference = grpc_generation(shim, prompt, EOS_IDS, max_tokens=20, **SAMPLED)
    api = client(shim).completions
    if stream:
        chunks = list(
            api.create(
                model=MODEL,
                prompt=prompt_text,
                max_tokens=20,
                stream=True,
                stream_options={"include_usage": True},
                **SAMPLED,
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = chunks[-2].choices[0].finish_reason
        usage = chunks[-1].usage
    else:
        reply = api.create(model=MODEL, prompt=prompt_text, max_tokens=20, **SAMPLED)
        text, finish, usage = reply.choices[0].text, reply.choices[0].finish_reason, reply.usage
    assert text == _expected_text(tiny_tokenizer, reference)
    assert finish == _expected_finish(reference)
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(reference.tokens))


def test_a_prompt_of_token_ids_is_generated_from_as_given(shim, tiny_tokenizer):
    prompt = tiny_tokenizer.encode("The sky is", add_special_tokens=False)
    reference = grpc_generation(shim, prompt, EOS_IDS, max_tokens=12)
    reply = client(shim).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert reply.choices[0].text == _expected_text(tiny_tokenizer, reference)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)


def test_completions_default_to_sixteen_tokens_and_chat_samples_at_temperature_one(shim, tiny_tokenizer):
    eos = EOS_IDS
    reference = grpc_generation(shim, tiny_tokenizer.encode("Hello"), eos, max_tokens=16)
    assert len(reference.tokens) == 16, "precondition: greedy decoding from 'Hello' runs 16 tokens without EOS"
    reply = client(shim).completions.create(model=MODEL, prompt="Hello", temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens == 16
    assert reply.choices[0].finish_reason == "length"
    # OpenAI's default temperature is 1: an unset temperature samples exactly like temperature=1.0 on gRPC
    prompt = _rendered(tiny_tokenizer, MESSAGES)
    reference = grpc_generation(shim, prompt, eos, max_tokens=16, temperature=1.0, seed=99)
    chat = client(shim).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, seed=99)
    assert chat.choices[0].message.content == _expected_text(tiny_tokenizer, reference)


def test_an_end_of_sequence_token_finishes_with_stop_and_is_counted_but_not_shown(shim, tiny_tokenizer):
    prompt = _rendered(tiny_tokenizer, MESSAGES)
    seed, reference = next(
        (seed, result)
        for seed in range(200)
        if (result := grpc_generation(shim, prompt, EOS_IDS, max_tokens=48, temperature=2.0, seed=seed)).tokens[-1]
        in EOS_IDS
    )
    reply = client(shim).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=48, temperature=2.0, seed=seed
    )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == len(reference.tokens)
    assert reply.choices[0].message.content == _expected_text(tiny_tokenizer, reference)


def _first_ascii_pair(text: str) -> str:
    for i in range(1, len(text) - 1):
        pair = text[i : i + 2]
        if pair.isascii() and pair.isprintable() and pair.strip() == pair:
            return pair
    raise AssertionError(f"no printable ASCII pair in {text!r}")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_stop_string_ends_the_text_before_it_and_counts_the_tokens_up_to_it(shim, tiny_tokenizer, stream):
    prompt = _rendered(tiny_tokenizer, MESSAGES)
    reference = grpc_generation(shim, prompt, EOS_IDS, max_tokens=40)
    full = _expected_text(tiny_tokenizer, reference)
    stop = _first_ascii_pair(full)
    cut = full.index(stop)
    # the stop is complete once the decoded tokens contain it: that many tokens were generated
    needed = next(n for n in range(1, len(reference.tokens) + 1) if stop in tiny_tokenizer.decode(reference.tokens[:n]))
    params = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "temperature": 0, "stop": ["\x00never", stop]}
    if stream:
        text, chunks = _stream_chat(shim, stream_options={"include_usage": True}, **params)
        finish, usage = chunks[-2].choices[0].finish_reason, chunks[-1].usage
    else:
        reply = client(shim).chat.completions.create(**params)
        text, finish, usage = reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage
    assert text == full[:cut]
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens == needed
    wait_until_no_session(shim)


def test_a_stop_string_that_never_appears_changes_nothing(shim):
    params = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    plain = client(shim).chat.completions.create(**params)
    stopped = client(shim).chat.completions.create(stop="\x00\x01", **params)
    assert stopped.choices[0].message.content == plain.choices[0].message.content
    assert stopped.choices[0].finish_reason == plain.choices[0].finish_reason == "length"


def test_models_lists_the_served_model_and_every_response_is_marked_deprecated(shim):
    api = client(shim)
    listed = api.models.with_raw_response.list()
    assert_deprecated(listed.headers)
    assert [m.id for m in listed.parse().data] == [MODEL]
    assert api.models.retrieve(MODEL).id == MODEL
    raw = api.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert_deprecated(raw.headers)
    assert raw.headers["x-request-id"]


def test_health_metrics_and_the_migration_guide_are_served(shim):
    health = httpx.get(shim.http_url + "/healthz", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert_deprecated(health.headers)
    guide = httpx.get(shim.http_url + "/docs/migration-from-openai.md", timeout=10)
    assert guide.status_code == 200 and "from_openai_messages" in guide.text
    echoed = httpx.get(shim.http_url + "/healthz", headers={"x-request-id": "abc-123"}, timeout=10)
    assert echoed.headers["x-request-id"] == "abc-123"


def test_the_shim_and_grpc_share_one_metrics_registry(shim):
    before = metric(shim, "kakeya_session_active")
    sid = shim.stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=[1, 2, 3])).session_id
    try:
        assert metric(shim, "kakeya_session_active") == before + 1  # a gRPC session, seen on the shim's /metrics
        assert shim.metrics_text() == httpx.get(shim.http_url + "/metrics", timeout=10).text
    finally:
        shim.stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    generated = metric(shim, "kakeya_generate_tokens_total")
    reply = client(shim).completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0)
    assert reply.usage is not None
    assert metric(shim, "kakeya_generate_tokens_total") == generated + reply.usage.completion_tokens
