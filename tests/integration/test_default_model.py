"""The default model, SmolLM2-135M-Instruct, through every surface of the daemon: SDK chats rendered with its own
ChatML template, every KV strategy and compressor, speculation, generation controls, batching, forks, the journal
across SIGKILL, the HTTP shim and GetModelInfo. Greedy, float32 on the CPU, short prompts and answers."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import kakeya
import numpy as np
import openai
import pytest
import torch
from kakeya.tokenization import AppendOnlyChat, load_tokenizer, tokens_for_chat

from inference_engine.generated import runtime_pb2 as pb
from inference_engine.generated import runtime_pb2_grpc
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from tests.support.concurrently import concurrently
from tests.support.daemon import Daemon
from tests.support.server import Generation, RunningServer, create, generate, info, start_server

VOCAB_SIZE = 49152
EOS_ID = 2  # <|im_end|>: generation_config.json's eos_token_id
SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1"  # the GGUF file it was converted from, less .gguf
FRANCE = "What is the capital of France?"
ITALY = "And of Italy?"
# Sink and window small enough that the two-turn chat (about 70 tokens) evicts positions in both turns.
WINDOW = {"sink_tokens": 4, "window_tokens": 16}
SESSION_OPTIONS: dict[str, dict[str, Any]] = {
    "full": {"kv_strategy": pb.KV_STRATEGY_FULL},
    "sink_window": {"kv_strategy": pb.KV_STRATEGY_SINK_WINDOW, **WINDOW},
    "dlm_restore": {"kv_strategy": pb.KV_STRATEGY_DLM_RESTORE, **WINDOW},
    "full+kakeya_d4": {"kv_strategy": pb.KV_STRATEGY_FULL, "kv_compressor": pb.KV_COMPRESSOR_KAKEYA_D4},
    "full+kakeya_e8": {"kv_strategy": pb.KV_STRATEGY_FULL, "kv_compressor": pb.KV_COMPRESSOR_KAKEYA_E8},
    "sink_window+kakeya_d4": {
        **WINDOW,
        "kv_strategy": pb.KV_STRATEGY_SINK_WINDOW,
        "kv_compressor": pb.KV_COMPRESSOR_KAKEYA_D4,
    },
    "sink_window+kakeya_e8": {
        **WINDOW,
        "kv_strategy": pb.KV_STRATEGY_SINK_WINDOW,
        "kv_compressor": pb.KV_COMPRESSOR_KAKEYA_E8,
    },
}


@pytest.fixture(scope="module")
def verifier(smollm2_dir: Path) -> TorchVerifier:
    return TorchVerifier.load(smollm2_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    """The model's tokenizer as a client loads it, with the model's own chat template."""
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def server(verifier: TorchVerifier, smollm2_dir: Path) -> Iterator[RunningServer]:
    """One daemon (gRPC and HTTP shim) for the module: batching on, `dlm_restore` recomputing every layer."""
    running = start_server(
        verifier,
        model_dir=smollm2_dir,
        model=str(smollm2_dir),
        restore_plan="recompute",
        max_concurrent=4,
        max_batch_size=4,
        http_port=0,
    )
    yield running
    running.stop()


@dataclass
class Chat:
    """A session driven turn by turn with the model's chat template."""

    session_id: str
    template: AppendOnlyChat
    turns: list[Generation]


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _chat(server: RunningServer, tokenizer: Any, questions: list[str], **options: Any) -> Chat:
    """Ask `questions` one turn each on a new session (greedy, at most 16 tokens an answer)."""
    chat = Chat(create(server.stub, **options), AppendOnlyChat(tokenizer), [])
    for question in questions:
        delta = chat.template.add_messages(_user(question))
        server.stub.AppendTokens(pb.AppendTokensRequest(session_id=chat.session_id, token_ids=delta))
        chat.turns.append(_answer(server, chat))
    return chat


def _answer(server: RunningServer, chat: Chat) -> Generation:
    result = generate(server.stub, chat.session_id, max_tokens=16)
    chat.template.add_generated(result.tokens)
    return result


def _text(tokenizer: Any, tokens: list[int]) -> str:
    return str(tokenizer.decode(tokens, skip_special_tokens=True))


@pytest.fixture(scope="module")
def reference_chat(server: RunningServer, tokenizer: Any) -> Chat:
    """France then Italy on a `full` session: the answers every other way of serving must match."""
    chat = _chat(server, tokenizer, [FRANCE, ITALY])
    assert "Paris" in _text(tokenizer, chat.turns[0].tokens)
    assert "Rome" in _text(tokenizer, chat.turns[1].tokens)
    return chat


def test_an_sdk_chat_answers_paris_then_rome_in_a_second_turn_of_the_same_session(server, tokenizer):
    with kakeya.Client(server.address) as client, client.create_session() as session:
        chat = AppendOnlyChat(tokenizer)
        answers, prefilled, deltas = [], [], []
        for question in (FRANCE, ITALY):
            deltas.append(chat.add_messages(_user(question)))
            assert session.append(deltas[-1]) == len(chat.tokens)
            stream = session.generate(32)
            tokens = list(stream)
            chat.add_generated(tokens)
            assert stream.stats is not None and stream.stats.stop_reason is kakeya.StopReason.EOS
            assert tokens[-1] == EOS_ID
            answers.append(_text(tokenizer, tokens))
            prefilled.append(stream.stats.prefill_token_count)
        # The second turn prefilled only its delta (and the first answer's last token, not yet in the cache).
        assert prefilled == [len(deltas[0]), len(deltas[1]) + 1]
        described = session.info(history_tail_tokens=len(chat.tokens))
        assert list(described.history_tail) == chat.tokens
    # That history is the template's rendering of the whole conversation, up to the newline that closes the last
    # reply (the next turn's delta starts with it).
    conversation = []
    for question, answer in zip((FRANCE, ITALY), answers, strict=True):
        conversation += [*_user(question), {"role": "assistant", "content": answer}]
    rendered = tokens_for_chat(conversation, tokenizer, add_generation_prompt=False)
    assert rendered == chat.tokens + tokenizer.encode("\n", add_special_tokens=False)
    assert "Paris" in answers[0], answers
    assert "Rome" in answers[1] and "Paris" not in answers[1], answers


@pytest.mark.parametrize("kind", list(SESSION_OPTIONS))
def test_every_kv_strategy_and_compressor_completes_a_chat_longer_than_the_window(
    server, tokenizer, reference_chat, kind
):
    options = SESSION_OPTIONS[kind]
    chat = _chat(server, tokenizer, [FRANCE, ITALY], **options)
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
        assert "Paris" in _text(tokenizer, chat.turns[0].tokens)
        assert "Rome" in _text(tokenizer, chat.turns[1].tokens)


REPEATING = (
    "Repeat this sentence twice: The quick brown fox jumps over the lazy dog. "
    "The quick brown fox jumps over the lazy dog."
)


@pytest.mark.parametrize("kind", ["full", "dlm_restore", "full+kakeya_d4"])
def test_the_ngram_proposer_streams_exactly_the_tokens_of_decoding_without_one(
    server, verifier, smollm2_dir, tokenizer, kind
):
    speculative = start_server(
        verifier,
        model_dir=smollm2_dir,
        model=str(smollm2_dir),
        restore_plan="recompute",
        proposer="ngram",
        num_draft_tokens=5,
        ngram_max_n=3,
    )
    try:
        options = SESSION_OPTIONS[kind]
        prompt = tokens_for_chat(_user(REPEATING), tokenizer)
        expected = generate(server.stub, create(server.stub, initial=prompt, **options), max_tokens=32)
        result = generate(speculative.stub, create(speculative.stub, initial=prompt, **options), max_tokens=32)
    finally:
        speculative.stop()
    assert "quick brown fox" in _text(tokenizer, expected.tokens)
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
    call = json.loads(_text(tokenizer, result.tokens))
    assert _valid_weather_call(call), call
    assert call["city"] == "Paris"
    unconstrained = generate(server.stub, create(server.stub, initial=prompt), max_tokens=32)
    assert unconstrained.tokens != result.tokens, "the grammar must change this output, or the test proves nothing"


def test_a_stop_sequence_ends_the_answer_right_after_its_first_match(server, tokenizer, reference_chat):
    free = reference_chat.turns[0].tokens
    stop = tokenizer.encode(" Paris", add_special_tokens=False)
    end = next(i + len(stop) for i in range(len(free)) if free[i : i + len(stop)] == stop)
    prompt = tokens_for_chat(_user(FRANCE), tokenizer)
    sequences = [
        pb.StopSequence(token_ids=tokenizer.encode(" Berlin", add_special_tokens=False)),
        pb.StopSequence(token_ids=stop),
    ]
    result = generate(server.stub, create(server.stub, initial=prompt), max_tokens=16, stop_sequences=sequences)
    assert result.tokens == free[:end] and end < len(free)
    assert result.done.stop_reason == pb.STOP_REASON_STOP_SEQUENCE and result.done.stop_sequence_index == 1
    assert _text(tokenizer, result.tokens).endswith(" Paris")


def test_logprobs_equal_a_plain_forward_of_the_model_and_the_greedy_token_is_the_best(
    server, verifier, tokenizer, reference_chat
):
    prompt = tokens_for_chat(_user(FRANCE), tokenizer)
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


def _shared_forwards(server: RunningServer) -> int:
    """Verifier forwards that held more than one session's step, from the batch size histogram."""
    text = server.metrics_text()

    def sample(series: str) -> float:
        found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
        assert found is not None, f"{series} is not exported"
        return float(found.group(1))

    return int(sample("kakeya_batch_size_count") - sample('kakeya_batch_size_bucket{le="1.0"}'))


BATCH_QUESTIONS = [
    "Which planet is known as the Red Planet?",
    "Name one primary colour.",
    "What is two plus two? Answer with a number.",
    "Write one short sentence about the sea, please.",
]


def test_concurrent_sessions_share_forwards_yet_each_gets_the_tokens_it_gets_alone(server, tokenizer):
    prompts = [tokens_for_chat(_user(q), tokenizer) for q in BATCH_QUESTIONS]
    before = _shared_forwards(server)
    alone = [generate(server.stub, create(server.stub, initial=p), max_tokens=16).tokens for p in prompts]
    assert _shared_forwards(server) == before, "sessions generating one after another never share a forward"
    assert "Mars" in _text(tokenizer, alone[0])

    sessions = [create(server.stub, initial=p) for p in prompts]
    together = concurrently([lambda s=s: generate(server.stub, s, max_tokens=16).tokens for s in sessions])
    assert together == alone
    assert _shared_forwards(server) > before, "the concurrent generations never shared a forward"


@pytest.mark.parametrize("kind", ["full", "dlm_restore", "full+kakeya_d4"])
def test_a_fork_mid_conversation_continues_like_its_parent_and_then_goes_its_own_way(
    server, tokenizer, reference_chat, kind
):
    options = SESSION_OPTIONS[kind]
    parent = _chat(server, tokenizer, [FRANCE], **options)
    reply = server.stub.ForkSession(pb.ForkSessionRequest(session_id=parent.session_id))
    assert reply.history_length == len(parent.template.tokens)
    assert reply.copied_token_count == len(parent.template.tokens) - 1, "the fork copies the K/V: no prefill"
    parent_info, fork_info = info(server.stub, parent.session_id), info(server.stub, reply.session_id)
    assert (fork_info.kv_strategy, fork_info.kv_compressor) == (parent_info.kv_strategy, parent_info.kv_compressor)
    # docs/kv-compression.md: a compressed fork copies the packed codes as they are.
    assert fork_info.kv_compressed_bytes == parent_info.kv_compressed_bytes
    # The fork's client replays the parent's chat so far: the same rendering, awaiting the same next turn.
    fork = Chat(reply.session_id, AppendOnlyChat(tokenizer), [])
    fork.template.add_messages(_user(FRANCE))
    fork.template.add_generated(parent.turns[0].tokens)
    assert fork.template.tokens == parent.template.tokens

    # The same next turn on both: the fork's continuation is the parent's.
    for chat in (parent, fork):
        delta = chat.template.add_messages(_user(ITALY))
        server.stub.AppendTokens(pb.AppendTokensRequest(session_id=chat.session_id, token_ids=delta))
        chat.turns.append(_answer(server, chat))
    assert fork.turns[-1].tokens == parent.turns[-1].tokens
    # The last generated token is not in the cache yet (it is fed to the next forward): delta + 1.
    assert fork.turns[-1].done.prefill_token_count == len(delta) + 1, "the fork prefilled only its own delta"

    # Then different turns: each answers its own question and sees nothing of the other's.
    for chat, question in ((parent, "And of Germany?"), (fork, "And of Spain?")):
        delta = chat.template.add_messages(_user(question))
        server.stub.AppendTokens(pb.AppendTokensRequest(session_id=chat.session_id, token_ids=delta))
        chat.turns.append(_answer(server, chat))
    for chat in (parent, fork):
        described = info(server.stub, chat.session_id, tail=len(chat.template.tokens))
        assert list(described.history_tail_token_ids) == chat.template.tokens
    if "kv_compressor" not in options:
        # Uncompressed (dlm_restore restores every evicted position): the answers of a `full` session.
        assert parent.turns[1].tokens == reference_chat.turns[1].tokens
        assert "Berlin" in _text(tokenizer, parent.turns[-1].tokens)
        assert "Madrid" in _text(tokenizer, fork.turns[-1].tokens)


@pytest.fixture
def daemons() -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def start(*args: str) -> Daemon:
        process = Daemon(*args)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()


def _serve_journaled(
    daemons: Callable[..., Daemon], model_dir: Path, state_dir: Path
) -> tuple[Daemon, grpc.Channel, runtime_pb2_grpc.RuntimeServiceStub]:
    process = daemons(
        "serve",
        "--model",
        str(model_dir),
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--log-format",
        "json",
        "--state-dir",
        str(state_dir),
    )
    host, port = process.wait_listening()
    channel = grpc.insecure_channel(f"{host}:{port}")
    return process, channel, runtime_pb2_grpc.RuntimeServiceStub(channel)


def test_a_session_survives_sigkill_and_its_next_answer_is_the_uninterrupted_one(
    daemons, smollm2_dir, tmp_path, tokenizer, reference_chat
):
    process, channel, stub = _serve_journaled(daemons, smollm2_dir, tmp_path / "state")
    template = AppendOnlyChat(tokenizer)
    session_id = create(stub, initial=template.add_messages(_user(FRANCE)))
    first = generate(stub, session_id, max_tokens=16)
    template.add_generated(first.tokens)
    assert first.tokens == reference_chat.turns[0].tokens
    process.kill()  # SIGKILL: nothing is flushed or closed on the way out
    channel.close()

    process, channel, stub = _serve_journaled(daemons, smollm2_dir, tmp_path / "state")
    restored = info(stub, session_id, tail=len(template.tokens))
    assert list(restored.history_tail_token_ids) == template.tokens
    assert restored.pending_token_count == restored.history_length, "the K/V is rebuilt by the next prefill"
    stub.AppendTokens(pb.AppendTokensRequest(session_id=session_id, token_ids=template.add_messages(_user(ITALY))))
    second = generate(stub, session_id, max_tokens=16)
    assert second.tokens == reference_chat.turns[1].tokens
    assert "Rome" in _text(tokenizer, second.tokens)
    channel.close()
    process.terminate()
    assert process.wait() == 0


def test_the_http_shim_renders_the_models_chatml_template_and_answers_paris(server, tokenizer, smollm2_dir):
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = _user(FRANCE)
    reply = client.chat.completions.create(model=SMOLLM2_NAME, messages=messages, max_tokens=16, temperature=0.0)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(tokens_for_chat(messages, tokenizer))
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert "Paris" in (choice.message.content or "")
    assert "<|im_end|>" not in (choice.message.content or "")


def test_model_info_reports_the_real_chat_template_vocabulary_and_end_of_sequence_id(server, smollm2_dir, tokenizer):
    reply = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert "<|im_start|>" in reply.chat_template
    assert reply.chat_template == (smollm2_dir / "chat_template.jinja").read_text()
    assert reply.vocab_size == VOCAB_SIZE == json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    assert list(reply.eos_token_ids) == [EOS_ID]
    assert tokenizer.convert_ids_to_tokens(EOS_ID) == "<|im_end|>"
    assert reply.trained_context_tokens == 8192
    assert reply.model_name == SMOLLM2_NAME and reply.backend == "torch"
