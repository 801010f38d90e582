"""Opt-in helpers that turn chat messages into token ids with a Hugging Face tokenizer's chat template.

The runtime only sees token ids: the client renders templates. Rendering a whole conversation again every turn is
a trap: many templates render earlier turns differently once the conversation has grown (Qwen3 drops earlier
turns' reasoning and renders the empty think block of `enable_thinking=False` only on the last turn), so the new
rendering is not an extension of the tokens the session already holds. `AppendOnlyChat` renders each new message
once, keeps generated tokens as the model produced them, and yields only append-only deltas.

Any object with the `ChatTokenizer` methods works (a `transformers` tokenizer does); `load_tokenizer` needs the
`tokenization` extra (`pip install 'kakeya[tokenization]'`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from kakeya.errors import InvalidArgument, KakeyaError

Message = Mapping[str, Any]

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# Placeholders that no template or tokenizer treats specially; they anchor the text of one turn in a rendering.
_PROBE_USER = "\u27e6kakeya probe user\u27e7"
_PROBE_REPLY = "\u27e6kakeya probe reply\u27e7"


class ChatTokenizer(Protocol):
    """The part of a Hugging Face tokenizer these helpers use."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


class TemplateError(KakeyaError):
    """The chat template cannot be used this way (it rendered something the helper cannot split into turns)."""


def load_tokenizer(path: str | Path) -> Any:
    """Load a local tokenizer directory with `transformers` (never downloads)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # the optional extra is missing
        raise ImportError("load_tokenizer needs transformers: pip install 'kakeya[tokenization]'") from exc
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def tokens_for_chat(messages: Sequence[Message], tokenizer: ChatTokenizer, **template_kwargs: Any) -> list[int]:
    """Render `messages` with the tokenizer's chat template and return the token ids.

    `add_generation_prompt` defaults to True; other keyword arguments (`enable_thinking`, `tools`, ...) go to the
    template unchanged.
    """
    template_kwargs.setdefault("add_generation_prompt", True)
    rendered = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=False, **template_kwargs)
    return [int(token) for token in rendered]


def render_chat_text(messages: Sequence[Message], tokenizer: ChatTokenizer, **template_kwargs: Any) -> str:
    """The chat template's text for `messages` (`add_generation_prompt` defaults to True)."""
    template_kwargs.setdefault("add_generation_prompt", True)
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, **template_kwargs)
    if not isinstance(text, str):
        raise TemplateError(f"the chat template rendered {type(text).__name__}, not text")
    return text


def openai_to_template_messages(messages: Iterable[Message]) -> list[dict[str, Any]]:
    """Convert OpenAI chat messages to the plain form chat templates expect.

    Text content parts are joined; tool calls get their JSON `arguments` parsed; `developer` becomes `system`.
    Non-text parts (images, audio, files) and unknown roles raise `InvalidArgument`.
    """
    converted = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidArgument(f"messages[{index}] must be a mapping, got {type(message).__name__}")
        role = message.get("role")
        if role not in _ROLES:
            raise InvalidArgument(f"messages[{index}].role {role!r} is not one of {', '.join(_ROLES)}")
        out: dict[str, Any] = {"role": _ROLES[role], "content": _text_content(message.get("content"), index)}
        if message.get("name"):
            out["name"] = message["name"]
        if role == "tool":
            out["tool_call_id"] = message.get("tool_call_id", "")
        if role == "assistant" and message.get("tool_calls"):
            out["tool_calls"] = [_tool_call(call, index) for call in message["tool_calls"]]
        converted.append(out)
    return converted


def from_openai_messages(
    messages: Iterable[Message],
    tokenizer: ChatTokenizer,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of OpenAI-style chat messages (and optional OpenAI `tools`), ready to append to a session."""
    if tools is not None:
        template_kwargs["tools"] = [dict(tool) for tool in tools]
    return tokens_for_chat(openai_to_template_messages(messages), tokenizer, **template_kwargs)


def _text_content(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(f"messages[{index}].content must be a string or a list of parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            texts.append(str(part.get("text", "")))
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            raise InvalidArgument(f"messages[{index}] has a content part of type {kind!r}; only text is supported")
    return "".join(texts)


def _tool_call(call: Any, index: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not function.get("name"):
        raise InvalidArgument(f"messages[{index}].tool_calls entries need a function with a name")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"messages[{index}] tool call {function['name']!r}: arguments are not JSON") from exc
    name = function["name"]
    return {"id": call.get("id", ""), "type": "function", "function": {"name": name, "arguments": arguments}}


class AppendOnlyChat:
    """A growing chat as append-only token deltas for one session.

    `add_messages` returns the tokens to append for new messages (the whole rendering the first time, the new
    turns plus the generation prompt afterwards); `add_generated` records a reply's tokens exactly as the model
    produced them. Earlier turns are never rendered again, so `tokens` only ever grows and always equals the
    session's history. Template keyword arguments (such as `enable_thinking=False`) apply to every rendering.

    A new turn is rendered after a probe exchange (user, assistant) and cut out after the probe reply's end of
    turn; the end-of-turn text (`<|im_end|>\\n` for ChatML) closes each reply, minus whatever of it the model
    already generated (its EOS token).
    """

    def __init__(self, tokenizer: ChatTokenizer, **template_kwargs: Any) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs
        self.tokens: list[int] = []
        self._awaiting_reply = False
        self._turn_close = self._probe_turn_close()
        self._close_tokens = self._encode(self._turn_close)
        self._pending_close: list[int] = []

    def add_messages(self, messages: Sequence[Message]) -> list[int]:
        """Tokens to append for `messages`, ending with the generation prompt; they are added to `tokens`."""
        if not messages:
            raise InvalidArgument("add_messages needs at least one message")
        if self._awaiting_reply:
            raise InvalidArgument("record the reply to the previous prompt with add_generated first")
        if not self.tokens:
            delta = tokens_for_chat(messages, self.tokenizer, **self.template_kwargs)
        else:
            delta = self._pending_close + self._encode(self._render_after_reply(messages))
        self._pending_close = []
        self._awaiting_reply = True
        self.tokens.extend(delta)
        return delta

    def add_generated(self, token_ids: Sequence[int]) -> None:
        """Record the tokens a generation added to the history (the stream's tokens, stop token included)."""
        if not self._awaiting_reply:
            raise InvalidArgument("add_generated follows add_messages")
        generated = [int(token) for token in token_ids]
        self.tokens.extend(generated)
        self._pending_close = self._close_tokens[_overlap(generated, self._close_tokens) :]
        self._awaiting_reply = False

    def _render_after_reply(self, messages: Sequence[Message]) -> str:
        probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}]
        text = render_chat_text([*probe, *messages], self.tokenizer, **self.template_kwargs)
        anchor = _PROBE_REPLY + self._turn_close
        at = text.find(anchor)
        if at < 0:
            raise TemplateError("the chat template does not end an assistant turn the same way inside a conversation")
        return text[at + len(anchor) :]

    def _probe_turn_close(self) -> str:
        probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}]
        kwargs = {**self.template_kwargs, "add_generation_prompt": False}
        text = render_chat_text(probe, self.tokenizer, **kwargs)
        at = text.find(_PROBE_REPLY)
        if at < 0:
            raise TemplateError("the chat template does not render assistant content verbatim")
        return text[at + len(_PROBE_REPLY) :]

    def _encode(self, text: str) -> list[int]:
        return [int(token) for token in self.tokenizer.encode(text, add_special_tokens=False)]


def _overlap(tokens: Sequence[int], close: Sequence[int]) -> int:
    """Length of the longest suffix of `tokens` that is a prefix of `close`."""
    for size in range(min(len(tokens), len(close)), 0, -1):
        if list(tokens[-size:]) == list(close[:size]):
            return size
    return 0
