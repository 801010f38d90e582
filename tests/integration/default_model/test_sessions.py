"""The default model, SmolLM2-135M-Instruct, across sessions: batching, forks, the journal across SIGKILL, the HTTP
shim and GetModelInfo. Greedy, float32 on the CPU, short prompts and answers."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import openai
import pytest
from kakeya.tokenization import AppendOnlyChat, tokens_for_chat

from inference_engine.generated import runtime_pb2 as pb
from inference_engine.generated import runtime_pb2_grpc
from tests.integration.default_model.chat import (
    EOS_ID,
    FRANCE,
    ITALY,
    SESSION_OPTIONS,
    SMOLLM2_NAME,
    VOCAB_SIZE,
    Chat,
    answer,
    start_chat,
    text,
    user,
)
from tests.support.concurrently import concurrently
from tests.support.daemon import Daemon
from tests.support.server import RunningServer, create, generate, info

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)


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
    prompts = [tokens_for_chat(user(q), tokenizer) for q in BATCH_QUESTIONS]
    before = _shared_forwards(server)
    alone = [generate(server.stub, create(server.stub, initial=p), max_tokens=16).tokens for p in prompts]
    assert _shared_forwards(server) == before, "sessions generating one after another never share a forward"
    assert "Mars" in text(tokenizer, alone[0])

    sessions = [create(server.stub, initial=p) for p in prompts]
    together = concurrently([lambda s=s: generate(server.stub, s, max_tokens=16).tokens for s in sessions])
    assert together == alone
    assert _shared_forwards(server) > before, "the concurrent generations never shared a forward"


@pytest.mark.parametrize("kind", ["full", "dlm_restore", "full+kakeya_d4"])
def test_a_fork_mid_conversation_continues_like_its_parent_and_then_goes_its_own_way(
    server, tokenizer, reference_chat, kind
):
    options = SESSION_OPTIONS[kind]
    parent = start_chat(server, tokenizer, [FRANCE], **options)
    reply = server.stub.ForkSession(pb.ForkSessionRequest(session_id=parent.session_id))
    assert reply.history_length == len(parent.template.tokens)
    assert reply.copied_token_count == len(parent.template.tokens) - 1, "the fork copies the K/V: no prefill"
    parent_info, fork_info = info(server.stub, parent.session_id), info(server.stub, reply.session_id)
    assert (fork_info.kv_strategy, fork_info.kv_compressor) == (parent_info.kv_strategy, parent_info.kv_compressor)
    # docs/kv-compression.md: a compressed fork copies the packed codes as they are.
    assert fork_info.kv_compressed_bytes == parent_info.kv_compressed_bytes
    # The fork's client replays the parent's chat so far: the same rendering, awaiting the same next turn.
    fork = Chat(reply.session_id, AppendOnlyChat(tokenizer), [])
    fork.template.add_messages(user(FRANCE))
    fork.template.add_generated(parent.turns[0].tokens)
    assert fork.template.tokens == parent.template.tokens

    # The same next turn on both: the fork's continuation is the parent's.
    for chat in (parent, fork):
        delta = chat.template.add_messages(user(ITALY))
        server.stub.AppendTokens(pb.AppendTokensRequest(session_id=chat.session_id, token_ids=delta))
        chat.turns.append(answer(server, chat))
    assert fork.turns[-1].tokens == parent.turns[-1].tokens
    # The last generated token is not in the cache yet (it is fed to the next forward): delta + 1.
    assert fork.turns[-1].done.prefill_token_count == len(delta) + 1, "the fork prefilled only its own delta"

    # Then different turns: each answers its own question and sees nothing of the other's.
    for chat, question in ((parent, "And of Germany?"), (fork, "And of Spain?")):
        delta = chat.template.add_messages(user(question))
        server.stub.AppendTokens(pb.AppendTokensRequest(session_id=chat.session_id, token_ids=delta))
        chat.turns.append(answer(server, chat))
    for chat in (parent, fork):
        described = info(server.stub, chat.session_id, tail=len(chat.template.tokens))
        assert list(described.history_tail_token_ids) == chat.template.tokens
    if "kv_compressor" not in options:
        # Uncompressed (dlm_restore restores every evicted position): the answers of a `full` session.
        assert parent.turns[1].tokens == reference_chat.turns[1].tokens
        assert "Berlin" in text(tokenizer, parent.turns[-1].tokens)
        assert "Madrid" in text(tokenizer, fork.turns[-1].tokens)


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
    session_id = create(stub, initial=template.add_messages(user(FRANCE)))
    first = generate(stub, session_id, max_tokens=16)
    template.add_generated(first.tokens)
    assert first.tokens == reference_chat.turns[0].tokens
    process.kill()  # SIGKILL: nothing is flushed or closed on the way out
    channel.close()

    process, channel, stub = _serve_journaled(daemons, smollm2_dir, tmp_path / "state")
    restored = info(stub, session_id, tail=len(template.tokens))
    assert list(restored.history_tail_token_ids) == template.tokens
    assert restored.pending_token_count == restored.history_length, "the K/V is rebuilt by the next prefill"
    stub.AppendTokens(pb.AppendTokensRequest(session_id=session_id, token_ids=template.add_messages(user(ITALY))))
    second = generate(stub, session_id, max_tokens=16)
    assert second.tokens == reference_chat.turns[1].tokens
    assert "Rome" in text(tokenizer, second.tokens)
    channel.close()
    process.terminate()
    assert process.wait() == 0


def test_the_http_shim_renders_the_models_chatml_template_and_answers_paris(server, tokenizer, smollm2_dir):
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = user(FRANCE)
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
