"""Text on the HTTP shim: the model's own tokenizer renders chat templates, encodes prompts and decodes output.

The shim is the only place a chat template is ever rendered; the session path takes raw token ids. Decoding is
incremental (a token may end in the middle of a character), and stop strings are matched on the decoded text.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from inference_engine.errors import InvalidArgument

log = logging.getLogger(__name__)

# Files of which at least one must be present for the directory to hold a tokenizer: without them transformers
# would build an empty tokenizer from the model config alone.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_INCOMPLETE = "\ufffd"  # what a decoder returns for a character whose bytes have not all arrived


class TokenizerUnavailable(InvalidArgument):
    """The model has no tokenizer, or no chat template, so this request cannot be served as text."""


class TextCodec:
    """The tokenizer of the served model directory, loaded offline (or the reason there is none)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        *,
        eos_token_ids: Sequence[int] = (),
        missing_reason: str = "",
    ) -> None:
        self._tokenizer = tokenizer
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self.missing_reason = missing_reason

    @classmethod
    def load(cls, model_dir: Path) -> TextCodec:
        """Load the tokenizer of `model_dir` (never from the network); a missing one is recorded, not fatal."""
        if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
            return cls(None, missing_reason=f"the model directory {model_dir} holds no tokenizer")
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except (OSError, ValueError) as exc:
            return cls(None, missing_reason=f"the tokenizer of {model_dir} cannot be loaded: {exc}")
        eos = {tokenizer.eos_token_id} if isinstance(tokenizer.eos_token_id, int) else set()
        eos |= _generation_eos_ids(model_dir)
        return cls(tokenizer, eos_token_ids=sorted(eos))

    @property
    def has_chat_template(self) -> bool:
        return self._tokenizer is not None and bool(self._tokenizer.chat_template)

    def render_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of `messages` rendered by the model's chat template, ending with the assistant turn's opening."""
        tokenizer = self._require()
        if not tokenizer.chat_template:
            raise TokenizerUnavailable(
                "the model's tokenizer has no chat template, so /v1/chat/completions cannot render messages; "
                "use /v1/completions with a prompt, or the gRPC API with your own tokens"
            )
        try:
            text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        except TemplateError as exc:
            raise InvalidArgument(f"the model's chat template rejected the messages: {exc}") from exc
        # The rendered text already holds every special token the template wants (BOS included).
        return list(tokenizer.encode(str(text), add_special_tokens=False))

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a plain completion prompt, with the special tokens the tokenizer adds to any input."""
        return list(self._require().encode(prompt, add_special_tokens=True))

    def decoder(self, stop: Sequence[str] = ()) -> TextDecoder:
        """A fresh incremental decoder for one generation, stopping at the first of `stop`."""
        return TextDecoder(self._require(), frozenset(self.eos_token_ids), StopStrings(tuple(stop)))

    def _require(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            raise TokenizerUnavailable(
                f"{self.missing_reason}: the HTTP shim needs the model's tokenizer to turn text into tokens; "
                "use the gRPC API with token ids instead"
            )
        return self._tokenizer


def _generation_eos_ids(model_dir: Path) -> set[int]:
    """The end-of-sequence ids of the model's generation_config.json (an id or a list of ids), if it has one."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return set()
    value = json.loads(path.read_text()).get("eos_token_id")
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


@dataclass(slots=True)
class StopStrings:
    """Finds the first stop string in a growing text and says how much of the text is safe to release."""

    stops: tuple[str, ...]
    longest: int = field(init=False)

    def __post_init__(self) -> None:
        self.longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, start: int) -> int | None:
        """Index of the earliest stop string in `text` that ends after `start`, or None."""
        begin = max(0, start - self.longest + 1)
        hits = [i for i in (text.find(s, begin) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def safe_length(self, text: str) -> int:
        """Length of the prefix of `text` that cannot turn into the start of a stop string when text is appended."""
        for keep in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-keep:]
            if any(s.startswith(tail) for s in self.stops):
                return len(text) - keep
        return len(text)


class TextDecoder:
    """Turns a generation's tokens into text deltas, holding back incomplete characters and possible stop strings.

    Each new token is decoded together with the few tokens before it and only the new part is kept, so tokenizers
    whose pieces depend on their neighbours (leading spaces) decode as they would in one piece.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: frozenset[int], stop: StopStrings) -> None:
        self._tokenizer = tokenizer
        self._eos = eos_token_ids
        self._stop = stop
        self._tokens: list[int] = []
        self._prefix_start = 0  # tokens[_prefix_start:_read_start] give context, tokens[_read_start:] are new
        self._read_start = 0
        self._text = ""  # everything decoded so far
        self._released = 0  # characters of _text handed out
        self.stopped = False  # a stop string was found; nothing more will be released

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text that became final (possibly empty)."""
        if self.stopped or token_id in self._eos:
            return ""
        self._tokens.append(token_id)
        context = self._decode(self._tokens[self._prefix_start : self._read_start])
        full = self._decode(self._tokens[self._prefix_start :])
        if len(full) <= len(context) or full.endswith(_INCOMPLETE):
            return ""
        self._text += full[len(context) :]
        self._prefix_start, self._read_start = self._read_start, len(self._tokens)
        return self._release(final=False)

    def finish(self) -> str:
        """The generation ended: decode what is still pending and release everything before any stop string."""
        if self.stopped:
            return ""
        if self._read_start < len(self._tokens):
            context = self._decode(self._tokens[self._prefix_start : self._read_start])
            self._text += self._decode(self._tokens[self._prefix_start :])[len(context) :]
            self._read_start = len(self._tokens)
        return self._release(final=True)

    @property
    def text(self) -> str:
        """The text released so far."""
        return self._text[: self._released]

    def _release(self, *, final: bool) -> str:
        end = len(self._text)
        if self._stop.stops:
            hit = self._stop.find(self._text, self._released)
            if hit is not None:
                end, self.stopped = hit, True
            elif not final:
                end = self._stop.safe_length(self._text)
        delta = self._text[self._released : end]
        self._released = max(self._released, end)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))
