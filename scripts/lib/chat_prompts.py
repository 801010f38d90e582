"""Chat-formatted prompts for an instruct verifier, cut from the offline corpus (the standard library's source).

Five kinds, each rendered with the model's own chat template and ending at the assistant's turn:
- `question`: a question about a function or class;
- `multi_turn`: two or three exchanges (earlier answers are docstrings) and a follow-up;
- `code`: write, complete or explain a piece of code;
- `tool_call`: tools described as JSON schemas in the system prompt, and a request to answer with one call;
- `document`: a long source excerpt followed by a question about it, cut to a chosen length in tokens.

The drafter is trained on prompts from the corpus's training files and measured on prompts from its held-out files
(`lib.corpus.split_sources`), so no measured prompt was ever trained on.
"""

from __future__ import annotations

import ast
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Protocol

from lib.corpus import STDLIB, read_text

KINDS = ("question", "multi_turn", "code", "tool_call", "document")

_QUESTIONS = (
    "What does `{name}` in Python's `{module}` module do?",
    "Explain `{module}.{name}` in simple terms.",
    "When would I use `{module}.{name}`? Give a short example.",
    "How do I {summary_lower}",
    "Can you explain this: {summary}",
)
_FOLLOW_UPS = (
    "Can you show an example?",
    "Why is that useful?",
    "Make it shorter, please.",
    "What are the common mistakes with it?",
    "How does that compare to the alternatives?",
    "Thanks. And what does it return?",
)
_CODE = (
    "Write a Python function `{name}{signature}` that {summary_lower}",
    "Complete this code:\n```python\n{prefix}",
    "Explain what this code does:\n```python\n{source}\n```",
    "Find a possible bug in this function:\n```python\n{source}\n```",
    "Add type hints and a docstring to this function:\n```python\n{source}\n```",
)
_DOCUMENT_QUESTIONS = (
    "What does `{name}` do in the code above?",
    "Summarize the code above in a few sentences.",
    "Which functions are defined above, and what are they for?",
    "Where is `{name}` defined above, and what does it take?",
    "Write a short test for `{name}` from the code above.",
)


class ChatTokenizer(Protocol):
    def encode(self, text: str, **kwargs: Any) -> list[int]: ...

    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


@dataclass(frozen=True, slots=True)
class Definition:
    """A documented top-level function or class of a corpus file."""

    module: str
    name: str
    signature: str
    summary: str
    doc: str
    source: str


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    kind: str
    tokens: list[int]


def _module(path: Path) -> str:
    name = str(path.relative_to(STDLIB)) if path.is_relative_to(STDLIB) else path.name
    return name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


@cache
def definitions(path: Path) -> tuple[Definition, ...]:
    """The documented public top-level functions and classes of one file."""
    text = read_text(path)
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return ()
    found = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        source = ast.get_source_segment(text, node)
        if not doc or not source:
            continue
        signature = f"({ast.unparse(node.args)})" if isinstance(node, ast.FunctionDef) else ""
        summary = " ".join(doc.strip().split("\n\n")[0].split())
        found.append(Definition(_module(path), node.name, signature, summary, doc.strip(), source))
    return tuple(found)


class ChatPromptBuilder:
    """Builds prompts of every kind from `paths` (corpus files) with `tokenizer`'s chat template."""

    def __init__(self, tokenizer: ChatTokenizer, paths: Sequence[Path]) -> None:
        self.tokenizer = tokenizer
        self.paths = [p for p in paths if definitions(p)]
        if not self.paths:
            raise ValueError("no corpus file holds a documented public function or class")

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def build(self, kind: str, rng: random.Random, *, length: int = 0) -> ChatPrompt:
        """One prompt of `kind`; a `document` prompt holds about `length` tokens (at least its question's)."""
        make: dict[str, Callable[[random.Random], list[dict[str, str]]]] = {
            "question": self._question,
            "multi_turn": self._multi_turn,
            "code": self._code,
            "tool_call": self._tool_call,
        }
        if kind == "document":
            return ChatPrompt(kind, self._document(rng, length))
        if kind not in make:
            raise ValueError(f"unknown prompt kind {kind!r}: one of {', '.join(KINDS)}")
        return ChatPrompt(kind, self.render(make[kind](rng)))

    def _pick(self, rng: random.Random) -> Definition:
        return rng.choice(definitions(rng.choice(self.paths)))

    @staticmethod
    def _fill(template: str, d: Definition) -> str:
        lower = d.summary[:1].lower() + d.summary[1:]
        prefix = "\n".join(d.source.splitlines()[: max(2, len(d.source.splitlines()) // 2)])
        return template.format(
            name=d.name,
            module=d.module,
            summary=d.summary,
            summary_lower=lower,
            signature=d.signature,
            source=_cut_lines(d.source, 60),
            prefix=_cut_lines(prefix, 40),
        )

    def _question(self, rng: random.Random) -> list[dict[str, str]]:
        return [{"role": "user", "content": self._fill(rng.choice(_QUESTIONS), self._pick(rng))}]

    def _multi_turn(self, rng: random.Random) -> list[dict[str, str]]:
        messages: list[dict[str, str]] = []
        for _ in range(rng.randint(1, 2)):
            d = self._pick(rng)
            messages.append({"role": "user", "content": self._fill(rng.choice(_QUESTIONS), d)})
            messages.append({"role": "assistant", "content": _cut_lines(d.doc, 12)})
        messages.append({"role": "user", "content": rng.choice(_FOLLOW_UPS)})
        return messages

    def _code(self, rng: random.Random) -> list[dict[str, str]]:
        return [{"role": "user", "content": self._fill(rng.choice(_CODE), self._pick(rng))}]

    def _tool_call(self, rng: random.Random) -> list[dict[str, str]]:
        tools = [self._pick(rng) for _ in range(rng.randint(2, 4))]
        schemas = [_schema(d) for d in tools]
        system = (
            "You are an assistant that can call tools. To call one, answer with a single JSON object "
            '{"name": ..., "arguments": {...}} and nothing else. Tools:\n' + "\n".join(json.dumps(s) for s in schemas)
        )
        wanted = rng.choice(tools)
        request = f"Please {wanted.summary[:1].lower() + wanted.summary[1:]}"
        return [{"role": "system", "content": system}, {"role": "user", "content": request}]

    def _document(self, rng: random.Random, length: int) -> list[int]:
        """A user turn of consecutive corpus text and a question about it, its text cut so the whole prompt holds
        about `length` tokens."""
        path = rng.choice(self.paths)
        d = rng.choice(definitions(path))
        question = self._fill(rng.choice(_DOCUMENT_QUESTIONS), d)
        overhead = len(self.render([{"role": "user", "content": f"```python\n\n```\n\n{question}"}]))
        budget = max(0, length - overhead)
        text = read_text(path)
        start = text.find(d.source)
        text = text[max(0, start - rng.randint(0, 8 * budget)) :] if start >= 0 else text
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        while len(ids) < budget:  # short file: go on with more files
            ids += self.tokenizer.encode("\n" + read_text(rng.choice(self.paths)), add_special_tokens=False)
        document = self.tokenizer.decode(ids[:budget])
        prompt = self.render([{"role": "user", "content": f"```python\n{document}\n```\n\n{question}"}])
        return prompt


def _decode(tokenizer: ChatTokenizer, ids: list[int]) -> str:
    decode = tokenizer.decode
    return str(decode(ids))


def _cut_lines(text: str, lines: int) -> str:
    kept = text.splitlines()[:lines]
    return "\n".join(kept)


def _schema(d: Definition) -> dict[str, Any]:
    """A JSON tool schema of a function: its name, summary and parameters (all strings)."""
    params: list[str] = []
    try:
        node = ast.parse(d.source).body[0]
    except (SyntaxError, IndexError):
        node = None
    if isinstance(node, ast.FunctionDef):
        params = [a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs] if a.arg != "self"]
    return {
        "name": f"{d.module}.{d.name}".replace(".", "_"),
        "description": d.summary[:200],
        "parameters": {"type": "object", "properties": {p: {"type": "string"} for p in params}, "required": params},
    }


def document_lengths(count: int, low: int, high: int, rng: random.Random) -> list[int]:
    """`count` lengths spread log-uniformly over [low, high]."""
    return [round(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(count)]


def chat_prompts(
    builder: ChatPromptBuilder, counts: dict[str, int], *, seed: int, document_range: tuple[int, int]
) -> list[ChatPrompt]:
    """`counts[kind]` prompts of each kind (documents of log-uniform lengths in `document_range`), seeded."""
    rng = random.Random(seed)
    prompts: list[ChatPrompt] = []
    for kind in KINDS:
        count = counts.get(kind, 0)
        if kind == "document":
            lengths = document_lengths(count, *document_range, rng)
            prompts += [builder.build(kind, rng, length=n) for n in lengths]
        else:
            prompts += [builder.build(kind, rng) for _ in range(count)]
    return prompts
