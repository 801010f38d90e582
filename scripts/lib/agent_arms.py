"""The arms of the agent bench: one agent conversation at a time against one server, turn by turn.

Every arm offers the same `Conversation`: `reply` adds messages and generates the start of the assistant's reply,
`continue_reply` writes text into the reply and generates more, `end_reply` writes the reply's last text and closes
it. Each request returns a `RequestStats`: the prompt tokens the server says it ran through the model, and the
`new_tokens` a server that keeps the conversation has to run, counted by a `TokenLedger` (the conversation's
append-only token history, kept with the SDK's `AppendOnlyChat`).

- `DaemonArm` (ours): the Python SDK, a session per conversation, only the ledger's deltas appended; the server's
  count is the generation's prefill tokens. A restart is a SIGKILL and a start on the same `--state-dir`.
- the OpenAI-style servers (the daemon's HTTP shim, llama-server, mlx_lm.server) are in lib/chat_arms.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import kakeya
from kakeya.tokenization import AppendOnlyChat, ChatTokenizer

from lib.peer_servers import DaemonProcess

Message = dict[str, str]


@dataclass(frozen=True, slots=True)
class RequestStats:
    """One request: `processed_tokens` is what the server reports it ran through the model for the prompt;
    `new_tokens` is what a server that kept the conversation had to run (the ledger's count)."""

    latency_s: float
    prompt_tokens: int
    processed_tokens: int
    new_tokens: int
    output_tokens: int


class TokenLedger:
    """One conversation as append-only token ids, and the new tokens of each request.

    A request's new tokens are the tokens appended since the previous generation plus that generation's last
    token, which was sampled but never run through the model. Text the client writes at the end of a reply (a
    tool call) is sent with the next request, before the end-of-turn tokens.
    """

    def __init__(self, tokenizer: ChatTokenizer, template: str) -> None:
        self.tokenizer = tokenizer
        self.chat = AppendOnlyChat(tokenizer, chat_template=template)
        self.length = 0
        self._reply: list[int] = []
        self._unsent: list[int] = []
        self._sampled = False

    def open_reply(self, messages: Sequence[Message]) -> list[int]:
        """Tokens to send for `messages`: the previous reply's written end, its end of turn, the new messages and
        the generation prompt."""
        tokens = self._unsent + self.chat.add_messages(messages)
        self._unsent, self._reply = [], []
        return tokens

    def write(self, text: str) -> list[int]:
        """Tokens of `text`, written into the open reply and sent now."""
        tokens = self.encode(text)
        self._reply += tokens
        return tokens

    def generated(self, tokens: Sequence[int]) -> None:
        self._reply += tokens
        self.length += len(tokens)
        self._sampled = self._sampled or bool(tokens)

    def close_reply(self, text: str) -> None:
        """End the reply with `text`, sent with the next request."""
        tail = self.encode(text)
        self.chat.add_generated(self._reply + tail)
        self._unsent = tail

    def count_new(self, sent: Sequence[int]) -> int:
        """Record `sent` as delivered; returns the request's new tokens."""
        new = len(sent) + int(self._sampled)
        self.length += len(sent)
        self._sampled = False
        return new

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)] if text else []


class Conversation(Protocol):
    def reply(self, messages: Sequence[Message], max_tokens: int) -> RequestStats: ...

    def continue_reply(self, text: str, max_tokens: int) -> RequestStats: ...

    def end_reply(self, text: str) -> None: ...

    def close(self) -> None: ...


class Arm(Protocol):
    name: str

    def start(self) -> None: ...

    def command(self) -> list[str]: ...

    def conversation(self, label: str) -> Conversation: ...

    def restart(self) -> dict[str, Any]: ...

    def stop(self) -> None: ...


# -- ours: the SDK ------------------------------------------------------------------------------------------------


class DaemonConversation:
    """A session holding the conversation; every request appends the ledger's delta and generates."""

    def __init__(self, arm: DaemonArm, label: str) -> None:
        self.arm = arm
        self.ledger = TokenLedger(arm.tokenizer, arm.template)
        self.session = arm.client().create_session(eos_token_ids=[], label=label)

    def reply(self, messages: Sequence[Message], max_tokens: int) -> RequestStats:
        return self._generate(self.ledger.open_reply(messages), max_tokens)

    def continue_reply(self, text: str, max_tokens: int) -> RequestStats:
        return self._generate(self.ledger.write(text), max_tokens)

    def end_reply(self, text: str) -> None:
        self.ledger.close_reply(text)

    def close(self) -> None:
        self.session.close()
        self.arm.conversations.remove(self)

    def _generate(self, sent: list[int], max_tokens: int) -> RequestStats:
        new = self.ledger.count_new(sent)
        prompt = self.ledger.length
        started = time.perf_counter()
        if sent:
            self.session.append(sent)
        tokens = list(self.session.generate(max_tokens))
        latency = time.perf_counter() - started
        stats = self.session.last_generation
        if stats is None:
            raise RuntimeError(f"{self.session!r}: the generation ended without statistics")
        self.ledger.generated(tokens)
        return RequestStats(latency, prompt, stats.prefill_token_count, new, len(tokens))


@dataclass(slots=True)
class DaemonArm:
    """Our daemon through the Python SDK, sessions journaled in `state_dir` so they survive a SIGKILL."""

    name: str
    flags: list[str]
    tokenizer: ChatTokenizer
    template: str
    state_dir: Path
    conversations: list[DaemonConversation] = field(default_factory=list)
    process: DaemonProcess | None = None
    _client: kakeya.Client | None = None

    def start(self) -> None:
        self.process = DaemonProcess([*self.flags, "--state-dir", str(self.state_dir)])
        self.process.start()
        self._client = kakeya.Client(self.process.address, timeout_s=3600.0)
        self._client.wait_until_ready(60.0)

    def command(self) -> list[str]:
        return self.process.command if self.process is not None else []

    def client(self) -> kakeya.Client:
        if self._client is None:
            raise RuntimeError("the arm is not started")
        return self._client

    def conversation(self, label: str) -> Conversation:
        conversation = DaemonConversation(self, label)
        self.conversations.append(conversation)
        return conversation

    def restart(self) -> dict[str, Any]:
        """SIGKILL, start on the same state directory, and take every open session up again by its id."""
        assert self.process is not None
        started = time.perf_counter()
        self.process.kill()
        self.client().close()
        self.start()
        for conversation in self.conversations:
            conversation.session = self.client().session(conversation.session.id)
        return {"how": "SIGKILL, restart on the same --state-dir", "restart_s": time.perf_counter() - started}

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
        if self.process is not None:
            self.process.stop()
