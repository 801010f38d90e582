"""The default model, SmolLM2-135M-Instruct, through the daemon's chat surface: SDK chats rendered with its own
ChatML template, every KV strategy and compressor, speculation and generation controls. Greedy, float32 on the CPU,
short prompts and answers."""

from __future__ import annotations

import json

import kakeya
import numpy as np
import pytest
import torch
from kakeya.tokenization import AppendOnlyChat, tokens_for_chat

from inference_engine.generated import runtime_pb2 as pb
from tests.integration.default_model.chat import (
    EOS_ID,
    FRANCE,
    ITALY,
    SESSION_OPTIONS,
    WINDOW,
    start_chat,
    text,
    user,
)
from tests.support.server import create, generate, info, start_server

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)


def test_an_sdk_chat_answers_paris_then_rome_in_a_second_turn_of_the_same_session(server, tokenizer):
    with kakeya.Client(server.address) as client, client.create_session() as session:
        chat = AppendOnlyChat(tokenizer)
        answers, prefilled, deltas = [], [], []
        for question in (FRANCE, ITALY):
            deltas.append(chat.add_messages(user(question)))
            assert session.append(deltas[-1]) == len(chat.tokens)
            stream = session.generate(32)
            tokens = list(stream)
            chat.add_generated(tokens)
            assert stream.stats is not None and stream.stats.stop_reason is kakeya.StopReason.EOS
            assert tokens[-1] == EOS_ID
            answers.append(text(tokenizer, tokens))
            prefilled.append(stream.stats.prefill_token_count)
        # The second turn prefilled only its delta (and the first answer's last token, not yet in the cache).
        assert prefilled == [len(deltas[0]), len(deltas[1]) + 1]
        described = session.info(history_tail_tokens=len(chat.tokens))
        assert list(described.history_tail) == chat.tokens
    # That history is the template's rendering of the whole conversation, up to the newline that closes the last
    # reply (the next turn's delta starts with it).
    conversation = []
    for question, answer in zip((FRANCE, ITALY), answers, strict=True):
        conversation += [*user(question), {"role": "assistant", "content": answer}]
    rendered = tokens_for_chat(conversation, tokenizer, add_generation_prompt=False)
    assert rendered == chat.tokens + tokenizer.encode("\n", add_special_tokens=False)
    assert "Paris" in answers[0], answers
    assert "Rome" in answers[1] and "Paris" not in answers[1], answers


@pytest.mark.parametrize("kind", list(SESSION_OPTIONS))
def test_every_kv_strategy_and_compressor_completes_a_chat_longer_than_the_window(
    server, tokenizer, reference_chat, kind
):
    options = SESSION_OPTIONS[kind]
    chat = start_chat(server, tokenizer, [FRANCE, ITALY], **options)
    for turn in chat.turns:
        if options["kv_strategy"] == pb.KV_STRATEGY_SINK_WINDOW:
            # A 16-token window forgets the question: the answer may run to max_tokens, but it is generated.
            assert turn.done.stop_reason in (pb.STOP_REASON_EOS, pb.STOP_REASON_MAX_TOKENS) and turn.tokens
        else:
            assert turn.done.stop_reason == pb.STOP_REASON_EOS and turn.tokens[-1] == EOS_ID
    described = info(server.stub, chat.session_id)
    assert described.kv_strategy == options["kv_strategy"]
    assert described.kv_compressor == options.get("kv_compressor", pb.KV_COMPRESSOR_NONE)
    assert described.history_length == len(chat.template.tokens)
    windowed = options["kv_strategy"] != pb.KV_STRATEGY_FULL
    if windowed:
        resident = WINDOW["sink_tokens"] + WINDOW["window_tokens"]
        assert described.evicted_token_count == described.history_length - 1 - resident > 0
    if options["kv_strategy"] == pb.KV_STRATEGY_SINK_WINDOW:
        # The evicted positions are reported before the first token of each turn that starts without them.
        assert all(turn.truncated and turn.truncated[0] > 0 for turn in chat.turns)
    else:
        assert all(not turn.truncated for turn in chat.turns)
    if kind == "dlm_restore":
        # docs/restoration.md: every evicted position is restored for every forward; `recompute` is full attention.
        assert [t.tokens for t in chat.turns] == [t.tokens for t in reference_chat.turns]
    if "kv_compressor" in options:
        assert described.kv_compressed_bytes > 0 and described.kv_live_bytes < described.kv_dense_equivalent_bytes
    if kind.startswith("full+"):
        # docs/kv-compression.md: what a position reads depends on positions alone, not on how tokens were grouped
        # into forwards, so a fresh session prefilling the same history in one forward continues the same way.
        before_last_turn = chat.template.tokens[: -len(chat.turns[-1].tokens)]
        fresh = generate(server.stub, create(server.stub, initial=before_last_turn, **options), max_tokens=16)
        assert fresh.tokens == chat.turns[-1].tokens
        # Not a contract, the measured greedy behaviour: the packed cache keeps the answers.
        assert "Paris" in text(tokenizer, chat.turns[0].tokens)
        assert "Rome" in text(tokenizer, chat.turns[1].tokens)


REPEATING = (
    "Repeat this sentence twice: The quick brown fox jumps over the lazy dog. "
    "The quick brown fox jumps over the lazy dog."
)


@pytest.mark.parametrize("kind", ["full", "dlm_restore", "full+kakeya_d4"])
def test_the_default_ngram_proposer_streams_exactly_the_tokens_of_decoding_without_one(
    server, verifier, smollm2_dir, tokenizer, kind
):
    plain = start_server(
        verifier, model_dir=smollm2_dir, model=str(smollm2_dir), restore_plan="recompute", proposer="none"
    )
    try:
        options = SESSION_OPTIONS[kind]
        prompt = tokens_for_chat(user(REPEATING), tokenizer)
        expected = generate(plain.stub, create(plain.stub, initial=prompt, **options), max_tokens=32)
        result = generate(server.stub, create(server.stub, initial=prompt, **options), max_tokens=32)
    finally:
        plain.stop()
    assert "quick brown fox" in text(tokenizer, expected.tokens)
    assert result.tokens == expected.tokens
    assert result.done.stop_reason == expected.done.stop_reason
    assert result.done.accepted_draft_token_count > 0, "the repeated sentence must get drafts accepted"
    assert result.done.verifier_forward_count < expected.done.verifier_forward_count


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_PROMPT = [
    {
        "role": "system",
        "content": "You can call the tool get_weather(city). Reply only with the JSON arguments of the call.",
    },
    {"role": "user", "content": "What is the weather like in Paris today?"},
]


def _valid_weather_call(document: object) -> bool:
    return isinstance(document, dict) and set(document) == {"city"} and isinstance(document["city"], str)


def test_a_json_schema_constrained_tool_call_parses_and_validates(server, tokenizer):
    prompt = tokens_for_chat(WEATHER_PROMPT, tokenizer)
    grammar = pb.GrammarConstraint(json_schema=json.dumps(WEATHER_SCHEMA))
    result = generate(server.stub, create(server.stub, initial=prompt), max_tokens=32, grammar=grammar)
    assert result.done.stop_reason == pb.STOP_REASON_EOS and result.tokens[-1] == EOS_ID
    call = json.loads(text(tokenizer, result.tokens))
    assert _valid_weather_call(call), call
    assert call["city"] == "Paris"
    unconstrained = generate(server.stub, create(server.stub, initial=prompt), max_tokens=32)
    assert unconstrained.tokens != result.tokens, "the grammar must change this output, or the test proves nothing"


def test_a_stop_sequence_ends_the_answer_right_after_its_first_match(server, tokenizer, reference_chat):
    free = reference_chat.turns[0].tokens
    stop = tokenizer.encode(" Paris", add_special_tokens=False)
    end = next(i + len(stop) for i in range(len(free)) if free[i : i + len(stop)] == stop)
    prompt = tokens_for_chat(user(FRANCE), tokenizer)
    sequences = [
        pb.StopSequence(token_ids=tokenizer.encode(" Berlin", add_special_tokens=False)),
        pb.StopSequence(token_ids=stop),
    ]
    result = generate(server.stub, create(server.stub, initial=prompt), max_tokens=16, stop_sequences=sequences)
    assert result.tokens == free[:end] and end < len(free)
    assert result.done.stop_reason == pb.STOP_REASON_STOP_SEQUENCE and result.done.stop_sequence_index == 1
    assert text(tokenizer, result.tokens).endswith(" Paris")


def test_logprobs_equal_a_plain_forward_of_the_model_and_the_greedy_token_is_the_best(
    server, verifier, tokenizer, reference_chat
):
    prompt = tokens_for_chat(user(FRANCE), tokenizer)
    result = generate(server.stub, create(server.stub, initial=prompt), max_tokens=16, logprobs=True, top_logprobs=3)
    assert result.tokens == reference_chat.turns[0].tokens, "asking for logprobs does not change the tokens"
    assert len(result.scored) == len(result.tokens)
    with torch.no_grad():
        logits = verifier.model(input_ids=torch.tensor([prompt + result.tokens[:-1]])).logits[0]
    expected = torch.log_softmax(logits[len(prompt) - 1 :].double(), dim=-1).numpy()  # [generated, vocab]
    for scored, row in zip(result.scored, expected, strict=True):
        best = np.argsort(-row, kind="stable")[:3]
        assert scored.logprob == pytest.approx(row[scored.token_id], abs=1e-4)
        assert [a.token_id for a in scored.top_logprobs] == best.tolist()
        assert [a.logprob for a in scored.top_logprobs] == pytest.approx(row[best].tolist(), abs=1e-4)
        assert scored.top_logprobs[0].token_id == scored.token_id
