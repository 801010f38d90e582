"""Chats with the default model, SmolLM2-135M-Instruct, driven turn by turn with its own ChatML template: the
sessions' options, the questions and the helpers the default model's tests share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kakeya.tokenization import AppendOnlyChat

from inference_engine.generated import runtime_pb2 as pb
from tests.support.server import Generation, RunningServer, create, generate

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
    "full+kakeya_d4s": {"kv_strategy": pb.KV_STRATEGY_FULL, "kv_compressor": pb.KV_COMPRESSOR_KAKEYA_D4S},
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


@dataclass
class Chat:
    """A session driven turn by turn with the model's chat template."""

    session_id: str
    template: AppendOnlyChat
    turns: list[Generation]


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def start_chat(server: RunningServer, tokenizer: Any, questions: list[str], **options: Any) -> Chat:
    """Ask `questions` one turn each on a new session (greedy, at most 16 tokens an answer)."""
    chat = Chat(create(server.stub, **options), AppendOnlyChat(tokenizer), [])
    for question in questions:
        delta = chat.template.add_messages(user(question))
        server.stub.AppendTokens(pb.AppendTokensRequest(session_id=chat.session_id, token_ids=delta))
        chat.turns.append(answer(server, chat))
    return chat


def answer(server: RunningServer, chat: Chat) -> Generation:
    result = generate(server.stub, chat.session_id, max_tokens=16)
    chat.template.add_generated(result.tokens)
    return result


def text(tokenizer: Any, tokens: list[int]) -> str:
    return str(tokenizer.decode(tokens, skip_special_tokens=True))
