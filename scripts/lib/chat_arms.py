"""The agent bench's arms on OpenAI-compatible servers: the daemon's HTTP shim, llama-server and mlx_lm.server.

The official `openai` client sends the whole message list every request, as an OpenAI client does; the reply in
progress is a last assistant message that the chat template continues. Each server's `ChatDialect` says which
request fields it takes, how to read what it generated and what it processed, and how it restarts (llama-server
saves and restores its slots; the others restart plainly). Every arm keeps a `TokenLedger` of the conversation to
count each request's new tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kakeya.tokenization import ChatTokenizer

from lib.agent_arms import Conversation, Message, RequestStats, TokenLedger
from lib.peer_servers import DaemonProcess, HttpServer


class ChatDialect(Protocol):
    """What differs between the HTTP servers: request fields, how a reply is read, how the server restarts."""

    def request_fields(self) -> dict[str, Any]: ...

    def reply_text(self, completion: Any) -> str: ...

    def processed_tokens(self, completion: Any) -> int: ...

    def restart(self, server: HttpServer | DaemonProcess) -> dict[str, Any]: ...


class ChatConversation:
    """The whole message list sent every request; the reply in progress is a last assistant message that the
    chat template continues."""

    def __init__(self, arm: ChatArm) -> None:
        self.arm = arm
        self.ledger = TokenLedger(arm.tokenizer, arm.template)
        self.messages: list[Message] = []
        self.reply_text = ""

    def reply(self, messages: Sequence[Message], max_tokens: int) -> RequestStats:
        sent = self.ledger.open_reply(messages)
        self.messages += messages
        self.reply_text = self.arm.reply_prefix
        return self._request(self.messages, sent, max_tokens)

    def continue_reply(self, text: str, max_tokens: int) -> RequestStats:
        sent = self.ledger.write(text)
        self.reply_text += text
        return self._request([*self.messages, {"role": "assistant", "content": self.reply_text}], sent, max_tokens)

    def end_reply(self, text: str) -> None:
        self.reply_text += text
        self.messages.append({"role": "assistant", "content": self.reply_text})
        self.ledger.close_reply(text)

    def close(self) -> None:
        self.messages = []

    def _request(self, messages: list[Message], sent: list[int], max_tokens: int) -> RequestStats:
        new = self.ledger.count_new(sent)
        started = time.perf_counter()
        completion = self.arm.client().chat.completions.create(
            model=self.arm.model_id,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.0,
            **self.arm.dialect.request_fields(),
        )
        latency = time.perf_counter() - started
        text = self.arm.dialect.reply_text(completion)
        self.reply_text += text
        self.ledger.generated(self.ledger.encode(text))
        usage = completion.usage
        assert usage is not None
        processed = self.arm.dialect.processed_tokens(completion)
        return RequestStats(latency, usage.prompt_tokens, processed, new, usage.completion_tokens)


@dataclass(slots=True)
class ChatArm:
    """An OpenAI-compatible server driven by the official `openai` client."""

    name: str
    server: HttpServer | DaemonProcess
    dialect: ChatDialect
    tokenizer: ChatTokenizer
    template: str
    reply_prefix: str
    model_id: str = ""
    _client: Any = None

    def start(self) -> None:
        self.server.start()
        self._connect()

    def command(self) -> list[str]:
        return self.server.command

    def client(self) -> Any:
        return self._client

    def conversation(self, label: str) -> Conversation:
        return ChatConversation(self)

    def restart(self) -> dict[str, Any]:
        started = time.perf_counter()
        record = self.dialect.restart(self.server)
        self._connect()
        return {**record, "restart_s": time.perf_counter() - started}

    def _connect(self) -> None:
        import openai

        base = self.server.openai_url
        self._client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=3600.0)
        if not self.model_id:  # the served model's id, unless the arm was given one
            self.model_id = self._client.models.list().data[0].id

    def stop(self) -> None:
        self.server.stop()


class ShimDialect:
    """The daemon's HTTP shim: every request is a single-shot session, so its whole prompt is processed; it
    refuses `logit_bias`, so generations end at the model's end of sequence."""

    def request_fields(self) -> dict[str, Any]:
        return {}

    def reply_text(self, completion: Any) -> str:
        return str(completion.choices[0].message.content or "")

    def processed_tokens(self, completion: Any) -> int:
        return int(completion.usage.prompt_tokens)

    def restart(self, server: HttpServer | DaemonProcess) -> dict[str, Any]:
        server.kill()
        server.start()
        return {"how": "SIGKILL, plain restart (single-shot sessions hold nothing)"}


@dataclass(frozen=True, slots=True)
class LlamaDialect:
    """llama-server: `timings.prompt_n` counts the prompt tokens it processed. The reply is read from the bytes of
    its tokens (`logprobs`): the message content drops leading whitespace, which would cost the next request its
    cache. End-of-sequence tokens are banned by `logit_bias`, so every generation runs to `max_tokens`."""

    banned_token_ids: tuple[int, ...]

    def request_fields(self) -> dict[str, Any]:
        return {"logit_bias": {str(t): -100 for t in self.banned_token_ids}, "logprobs": True}

    def reply_text(self, completion: Any) -> str:
        pieces = completion.choices[0].logprobs.content or []
        return b"".join(bytes(piece.bytes or piece.token.encode()) for piece in pieces).decode("utf-8", "replace")

    def processed_tokens(self, completion: Any) -> int:
        return int(completion.model_extra["timings"]["prompt_n"])

    def restart(self, server: HttpServer | DaemonProcess) -> dict[str, Any]:
        """Save every slot through the /slots API, SIGKILL, start, restore the slots."""
        assert isinstance(server, HttpServer)
        saved = {}
        started = time.perf_counter()
        for slot in server.get("/slots"):
            name = f"slot-{slot['id']}.bin"
            try:
                saved[slot["id"]] = server.post(f"/slots/{slot['id']}?action=save", {"filename": name})["n_saved"]
            except OSError:  # an empty slot has nothing to save
                continue
        save_s = time.perf_counter() - started
        server.kill()
        server.start()
        started = time.perf_counter()
        restored = {}
        for slot_id in saved:
            reply = server.post(f"/slots/{slot_id}?action=restore", {"filename": f"slot-{slot_id}.bin"})
            restored[slot_id] = reply["n_restored"]
        return {
            "how": "slots saved through /slots, SIGKILL, restart, slots restored",
            "saved_tokens": sum(saved.values()),
            "restored_tokens": sum(restored.values()),
            "save_s": save_s,
            "restore_s": time.perf_counter() - started,
        }


@dataclass(frozen=True, slots=True)
class MlxDialect:
    """mlx_lm.server: `usage.prompt_tokens_details.cached_tokens` is the prompt it took from its prompt cache, the
    rest it processed. End-of-sequence tokens are banned by `logit_bias`. It has no way to keep its cache across a
    restart."""

    banned_token_ids: tuple[int, ...]

    def request_fields(self) -> dict[str, Any]:
        return {"logit_bias": {str(t): -100 for t in self.banned_token_ids}}

    def reply_text(self, completion: Any) -> str:
        return str(completion.choices[0].message.content or "")

    def processed_tokens(self, completion: Any) -> int:
        usage = completion.usage
        details = usage.prompt_tokens_details
        cached = int(details.cached_tokens or 0) if details is not None else 0
        return int(usage.prompt_tokens) - cached

    def restart(self, server: HttpServer | DaemonProcess) -> dict[str, Any]:
        server.kill()
        server.start()
        return {"how": "SIGKILL, plain restart (mlx_lm.server keeps no cache across restarts)"}
