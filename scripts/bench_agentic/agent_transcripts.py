"""Seeded agent transcripts: what a coding agent sends a server, turn by turn, with every length drawn from a range.

A transcript is planned before any server runs, from the seed, the length ranges and the model's tokenizer, so
every server under test gets the same requests. An agent works through tasks in one conversation:

- the conversation opens with a system prompt that defines the tools (JSON schemas) and the first user request;
- each turn adds one message (a user request, or a tool result wrapped in `<tool_response>`), then the server
  generates the assistant's reasoning inside `<think>...</think>` (greedy, exactly the drawn number of tokens);
- the turn ends with a JSON tool call the generator writes (`<tool_call>...</tool_call>` after the reasoning), or,
  on a task's last turn, with a final answer the server generates after the closed think block;
- tool results are real text available offline: Python standard-library source files (`read_file`) and the
  docstrings of its functions and classes (`search_code`), cut to the drawn number of tokens;
- a conversation that could no longer hold the next task within `max_history_tokens` (the model's context) ends,
  and the agent opens a new one, as agent applications do when a context fills up.

The chat templates the bench ships (`TEMPLATES`, in templates/) render these messages: SmolLM2's append-only ChatML,
and a variant that drops earlier assistant turns' reasoning when it re-renders them, as Qwen3's template does.

Usage:
    python scripts/bench_agentic/agent_transcripts.py [--model NAME|DIR|GGUF] [--agents 1] [--turns 6] [--seed 0]
        [--reasoning-tokens 100-1000] [--tool-result-tokens 200-2000] [--answer-tokens 50-300]
        [--tool-calls-per-task 1-4] [--max-history-tokens 7680]

    prints the planned turns as JSON lines (one per turn) with their drawn lengths.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lib.corpus import read_text, stdlib_sources

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
TEMPLATES = {"append_only": "chatml_append_only.jinja", "drop_reasoning": "chatml_drop_reasoning.jinja"}
# What a rendered message adds around its content (`<|im_start|>role\n`, `<|im_end|>\n`), for planning only.
MESSAGE_OVERHEAD_TOKENS = 5
THINK_OPEN = "<think>\n"
THINK_CLOSE = "\n</think>\n"
TOOLS = [
    {
        "name": "read_file",
        "description": "Read a source file of the Python standard library from a line on.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "line": {"type": "integer", "minimum": 1}},
            "required": ["path"],
        },
    },
    {
        "name": "search_code",
        "description": "Search the Python standard library; returns matching functions and classes with docstrings.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
]
SYSTEM_PROMPT = (
    "You are a coding agent that answers questions about the Python standard library. You may call these tools:\n"
    "<tools>\n" + "\n".join(json.dumps(tool) for tool in TOOLS) + "\n</tools>\n"
    "Think step by step inside <think></think>. Then either call one tool, written as "
    '<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, or give your final answer.'
)
_REQUESTS = (
    "How does `{name}` in `{module}` work? Find its definition and explain it.",
    "I am getting unexpected results from `{module}.{name}`. Read its source and tell me what it does with its "
    "arguments.",
    "Write a short usage example for `{module}.{name}`, after checking how it is implemented.",
    "What are the edge cases of `{module}.{name}`? Look at the code before answering.",
)

Message = dict[str, str]


def load_template(name: str) -> str:
    """The text of a shipped chat template (`append_only` or `drop_reasoning`)."""
    return (TEMPLATES_DIR / TEMPLATES[name]).read_text()


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the generator uses."""

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...

    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...


@dataclass(frozen=True, slots=True)
class LengthRange:
    """An inclusive range of lengths, drawn uniformly; written `LOW-HIGH` (or `N` for one length)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high:
            raise ValueError(f"a length range needs 0 <= low <= high, got {self.low}-{self.high}")

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        low, _, high = text.partition("-")
        try:
            return cls(int(low), int(high or low))
        except ValueError as exc:
            raise ValueError(f"{text!r} is not a length range LOW-HIGH: {exc}") from None

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"


@dataclass(frozen=True, slots=True)
class TranscriptConfig:
    """How transcripts are drawn: lengths in tokens of the model's tokenizer."""

    seed: int = 0
    reasoning_tokens: LengthRange = LengthRange(100, 1000)
    tool_result_tokens: LengthRange = LengthRange(200, 2000)
    answer_tokens: LengthRange = LengthRange(50, 300)
    tool_calls_per_task: LengthRange = LengthRange(1, 4)
    max_history_tokens: int = 7680

    def __post_init__(self) -> None:
        if self.reasoning_tokens.low < 1 or self.answer_tokens.low < 1 or self.tool_result_tokens.low < 1:
            raise ValueError("reasoning, answer and tool result lengths must be at least 1 token")
        if self.tool_calls_per_task.low < 1:
            raise ValueError("a task makes at least one tool call")
        if self.max_history_tokens < 1:
            raise ValueError("max_history_tokens must be >= 1")


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn of one agent: the messages added, then the reply the server completes.

    `messages` start with the system prompt when the turn opens a conversation. The reply is `reasoning_tokens`
    generated tokens after the generation prompt's `<think>`, then either `tool_call` (written by the client after
    `THINK_CLOSE`) or `answer_tokens` generated after `THINK_CLOSE`. `history_tokens` estimates the conversation's
    length after the turn.
    """

    agent: int
    index: int
    new_conversation: bool
    messages: tuple[Message, ...]
    reasoning_tokens: int
    tool_call: str | None
    answer_tokens: int
    history_tokens: int


class ToolCorpus:
    """Tool results cut from the standard library's source: files for `read_file`, docstrings for `search_code`."""

    def __init__(self, tokenizer: Tokenizer, paths: Sequence[Path] | None = None) -> None:
        self.tokenizer = tokenizer
        self.paths = list(paths) if paths is not None else stdlib_sources()
        self.root = Path(ast.__file__).parent
        self._sizes = {path: path.stat().st_size for path in self.paths}

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def cut(self, text: str, tokens: int) -> str:
        """`text` cut to its first `tokens` tokens."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return text if len(ids) <= tokens else self.tokenizer.decode(ids[:tokens])

    def read_file(self, rng: random.Random, tokens: int) -> tuple[dict[str, Any], str]:
        """(call arguments, result): a file from a line on, leaving at least 4 bytes per token to read."""
        wanted = 4 * tokens
        long_enough = [p for p in self.paths if self._sizes[p] >= wanted] or self.paths
        path = rng.choice(long_enough)
        lines = read_text(path).splitlines(keepends=True)
        remaining = len("".join(lines))
        starts = []
        for number, text in enumerate(lines, start=1):
            if remaining < wanted:
                break
            starts.append(number)
            remaining -= len(text)
        line = rng.choice(starts or [1])
        return {"path": self._name(path), "line": line}, self.cut("".join(lines[line - 1 :]), tokens)

    def search_code(self, rng: random.Random, tokens: int) -> tuple[dict[str, Any], str]:
        """(call arguments, result): docstrings of functions and classes from random files, until `tokens`."""
        query = rng.choice(self._definitions(rng.choice(self.paths)) or [("", "open")])[1]
        parts: list[str] = []
        used = 0
        for _ in range(50):
            path = rng.choice(self.paths)
            for line, name, doc in self._docstrings(path)[:4]:
                part = f"{self._name(path)}:{line} {name}\n    {doc.strip()}\n"
                parts.append(part)
                used += self.count(part)
                if used >= tokens:
                    return {"query": query}, self.cut("".join(parts), tokens)
        return {"query": query}, self.cut("".join(parts), tokens)

    def request(self, rng: random.Random) -> str:
        """A user request about a function or class of a random module."""
        for _ in range(20):
            path = rng.choice(self.paths)
            names = self._definitions(path)
            if names:
                name = rng.choice(names)[1]
                module = self._name(path).removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                return rng.choice(_REQUESTS).format(module=module, name=name)
        return _REQUESTS[0].format(module="json", name="dumps")

    def _name(self, path: Path) -> str:
        return str(path.relative_to(self.root)) if path.is_relative_to(self.root) else path.name

    @staticmethod
    def _tree(path: Path) -> ast.Module | None:
        try:
            return ast.parse(read_text(path))
        except (SyntaxError, ValueError):
            return None

    def _definitions(self, path: Path) -> list[tuple[int, str]]:
        tree = self._tree(path)
        if tree is None:
            return []
        kinds = (ast.FunctionDef, ast.ClassDef)
        return [(n.lineno, n.name) for n in tree.body if isinstance(n, kinds) and not n.name.startswith("_")]

    def _docstrings(self, path: Path) -> list[tuple[int, str, str]]:
        tree = self._tree(path)
        if tree is None:
            return []
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        return [
            (n.lineno, n.name, doc) for n in ast.walk(tree) if isinstance(n, kinds) and (doc := ast.get_docstring(n))
        ]


@dataclass(slots=True)
class _Task:
    request: str
    results: list[Message] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    reasoning: list[int] = field(default_factory=list)
    answer_tokens: int = 0

    def tokens(self, count: Callable[[str], int]) -> int:
        """Planned tokens the task adds to a conversation."""
        added = [[self.request], *([m["content"]] for m in self.results)]
        tails = [*self.calls, ""]
        answers = [0] * len(self.calls) + [self.answer_tokens]
        return sum(
            turn_tokens(count, texts, reasoning, tail, answer)
            for texts, reasoning, tail, answer in zip(added, self.reasoning, tails, answers, strict=True)
        )


def turn_tokens(count: Callable[[str], int], added: Sequence[str], reasoning: int, tail: str, answer: int) -> int:
    """Planned tokens a turn adds: its messages, the reply's generated and written parts, the chat markup."""
    messages = sum(count(text) + MESSAGE_OVERHEAD_TOKENS for text in added)
    reply = MESSAGE_OVERHEAD_TOKENS + count(THINK_OPEN) + reasoning + count(THINK_CLOSE + tail) + answer
    return messages + reply


class TranscriptPlanner:
    """Plans agents' turns from a `TranscriptConfig`; the same config, tokenizer and corpus give the same turns."""

    def __init__(self, config: TranscriptConfig, corpus: ToolCorpus) -> None:
        self.config = config
        self.corpus = corpus
        self.system = {"role": "system", "content": SYSTEM_PROMPT}
        self.system_tokens = corpus.count(SYSTEM_PROMPT) + MESSAGE_OVERHEAD_TOKENS

    def plan_agent(self, agent: int, turns: int) -> list[Turn]:
        """The first `turns` turns of agent number `agent`."""
        rng = random.Random(f"{self.config.seed}:{agent}")
        planned: list[Turn] = []
        history = 0
        while len(planned) < turns:
            task = self._task(rng)
            size = task.tokens(self.corpus.count)
            new_conversation = history == 0 or history + size > self.config.max_history_tokens
            history = self.system_tokens if new_conversation else history
            for step, reasoning in enumerate(task.reasoning):
                if len(planned) == turns:
                    break
                added: list[Message] = [{"role": "user", "content": task.request}] if step == 0 else []
                if step > 0:
                    added.append(task.results[step - 1])
                call = task.calls[step] if step < len(task.calls) else None
                answer = 0 if call is not None else task.answer_tokens
                texts = [m["content"] for m in added]
                history += turn_tokens(self.corpus.count, texts, reasoning, call or "", answer)
                opens = new_conversation and step == 0
                messages = (self.system, *added) if opens else tuple(added)
                planned.append(Turn(agent, len(planned), opens, messages, reasoning, call, answer, history))
        return planned

    def plan(self, agents: int, turns: int) -> list[list[Turn]]:
        """Every agent's turns."""
        return [self.plan_agent(agent, turns) for agent in range(agents)]

    def _task(self, rng: random.Random) -> _Task:
        config = self.config
        task = _Task(self.corpus.request(rng))
        for _ in range(config.tool_calls_per_task.draw(rng)):
            tool = rng.choice(("read_file", "search_code"))
            length = config.tool_result_tokens.draw(rng)
            arguments, result = getattr(self.corpus, tool)(rng, length)
            task.calls.append("<tool_call>\n" + json.dumps({"name": tool, "arguments": arguments}) + "\n</tool_call>")
            task.results.append({"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"})
        task.reasoning = [config.reasoning_tokens.draw(rng) for _ in range(len(task.calls) + 1)]
        task.answer_tokens = config.answer_tokens.draw(rng)
        # A task larger than a whole conversation makes fewer calls.
        while len(task.calls) > 1 and self.system_tokens + task.tokens(self.corpus.count) > config.max_history_tokens:
            task.calls.pop()
            task.results.pop()
            task.reasoning.pop()
        return task


def round_robin(plans: Sequence[Sequence[Turn]]) -> list[Turn]:
    """The agents' turns interleaved: turn 0 of every agent, then turn 1 of every agent, ..."""
    longest = max((len(p) for p in plans), default=0)
    return [plan[index] for index in range(longest) for plan in plans if index < len(plan)]


def add_transcript_options(parser: argparse.ArgumentParser) -> None:
    """The `TranscriptConfig` flags."""
    defaults = TranscriptConfig()
    parser.add_argument("--seed", type=int, default=defaults.seed)
    for name, help_text in (
        ("reasoning_tokens", "reasoning generated per turn"),
        ("tool_result_tokens", "tokens of a tool result"),
        ("answer_tokens", "final answer generated at a task's end"),
        ("tool_calls_per_task", "tool calls before a task's final answer"),
    ):
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        parser.add_argument(
            flag, type=LengthRange.parse, default=default, metavar="LOW-HIGH", help=f"{help_text} ({default})"
        )
    parser.add_argument(
        "--max-history-tokens",
        type=int,
        default=defaults.max_history_tokens,
        help="an agent opens a new conversation rather than pass this many tokens, as planned (default: "
        "%(default)s: SmolLM2's 8,192-token context less a margin for the estimate)",
    )


def transcript_config(args: argparse.Namespace) -> TranscriptConfig:
    return TranscriptConfig(
        seed=args.seed,
        reasoning_tokens=args.reasoning_tokens,
        tool_result_tokens=args.tool_result_tokens,
        answer_tokens=args.answer_tokens,
        tool_calls_per_task=args.tool_calls_per_task,
        max_history_tokens=args.max_history_tokens,
    )


def main(argv: Sequence[str] | None = None) -> int:
    from lib.model_option import add_model_option

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser, "the model whose tokenizer measures the lengths")
    parser.add_argument("--agents", type=int, default=1)
    parser.add_argument("--turns", type=int, default=6)
    add_transcript_options(parser)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    planner = TranscriptPlanner(transcript_config(args), ToolCorpus(tokenizer))
    for turn in round_robin(planner.plan(args.agents, args.turns)):
        print(json.dumps(asdict(turn)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
