"""Needle-in-a-haystack documents: a key/value fact hidden in filler, asked for at the end.

Code documents (`build_document`): filler lines (source code) with the needle line
`# The secret code for KEY is VALUE.` inserted at a chosen depth, followed by the question
`# Question: what is the secret code for KEY?` and the answer prefix `# Answer: the secret code for KEY is`; the
model should continue with ` VALUE.`. Training documents may hold several needles, each asked for at the end with
its answer.

Chat documents (`build_chat_document`): prose paragraphs with the sentence `The secret code for KEY is VALUE.`
among them and the question in the same user turn, in the model's chat template.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_FIRST = (
    "amber",
    "azure",
    "bronze",
    "cobalt",
    "coral",
    "crimson",
    "golden",
    "indigo",
    "ivory",
    "jade",
    "lilac",
    "maroon",
    "olive",
    "pearl",
    "ruby",
    "scarlet",
    "silver",
    "teal",
    "umber",
    "violet",
)
_SECOND = (
    "badger",
    "comet",
    "dragon",
    "falcon",
    "fjord",
    "glacier",
    "harbor",
    "heron",
    "lantern",
    "meadow",
    "otter",
    "quartz",
    "raven",
    "river",
    "summit",
    "thistle",
    "tiger",
    "walrus",
    "willow",
    "zephyr",
)

Encode = Callable[[str], list[int]]


@dataclass(frozen=True, slots=True)
class Needle:
    key: str
    value: str

    def fact(self) -> str:
        return f"# The secret code for {self.key} is {self.value}.\n"

    def question(self) -> str:
        return f"\n# Question: what is the secret code for {self.key}?\n# Answer: the secret code for {self.key} is"

    def answer(self) -> str:
        return f" {self.value}.\n"


def random_needle(rng: random.Random) -> Needle:
    return Needle(f"{rng.choice(_FIRST)}_{rng.choice(_SECOND)}", str(rng.randrange(100000, 1000000)))


@dataclass(frozen=True, slots=True)
class Document:
    """Token ids of a document; `prompt` ends right before the (last) answer."""

    prompt: list[int]
    answer: list[int]
    needles: tuple[Needle, ...]
    depths: tuple[float, ...]
    answer_spans: tuple[tuple[int, int], ...]  # [start, end) of every answer in prompt + answer


def build_document(
    filler_lines: Sequence[list[int]],
    encode: Encode,
    length: int,
    depths: Sequence[float],
    rng: random.Random,
) -> Document:
    """A document of about `length` tokens (prompt + answer) with one needle per depth (0 = start, 1 = end of the
    filler). Earlier needles are asked and answered in the prompt; the last one's answer is `answer`."""
    needles = tuple(random_needle(rng) for _ in depths)
    facts = [encode(n.fact()) for n in needles]
    asks = [encode(n.question()) for n in needles]
    answers = [encode(n.answer()) for n in needles]
    overhead = sum(map(len, facts)) + sum(map(len, asks)) + sum(map(len, answers))
    budget = max(0, length - overhead)
    start = rng.randrange(len(filler_lines))
    filler: list[list[int]] = []
    used = 0
    while used < budget:
        line = filler_lines[(start + len(filler)) % len(filler_lines)][: budget - used]
        filler.append(line)
        used += len(line)
    inserts: dict[int, list[int]] = {}
    for i in sorted(range(len(needles)), key=lambda i: depths[i]):
        inserts.setdefault(round(depths[i] * len(filler)), []).append(i)
    body: list[int] = []
    for index in range(len(filler) + 1):
        for i in inserts.get(index, ()):
            body += facts[i]
        if index < len(filler):
            body += filler[index]
    spans = []
    for i in range(len(needles) - 1):
        body += asks[i]
        spans.append((len(body), len(body) + len(answers[i])))
        body += answers[i]
    body += asks[-1]
    spans.append((len(body), len(body) + len(answers[-1])))
    return Document(prompt=body, answer=answers[-1], needles=needles, depths=tuple(depths), answer_spans=tuple(spans))


@dataclass(frozen=True, slots=True)
class ChatDocument:
    """A chat needle test: `prompt` (the chat template's tokens, ending where the assistant answers) holds a long
    document with one fact, and the user turn asks for it; the answer recalls it when it contains `value`."""

    prompt: list[int]
    key: str
    value: str
    depth: float


def build_chat_document(
    tokenizer: Any, filler: Sequence[str], length: int, depth: float, rng: random.Random
) -> ChatDocument:
    """A document of prose paragraphs from `filler` (starting at a random one) with the sentence `The secret code
    for KEY is VALUE.` as a paragraph at `depth` (0 = first, 1 = last), then the question, all in one user turn
    rendered with the model's chat template: at most `length` tokens, and within a line of prose of it (the last
    paragraph is cut at a line to fill the budget, and lines come off the end while the rendered prompt is over)."""
    needle = random_needle(rng)
    fact = f"The secret code for {needle.key} is {needle.value}."
    question = f"What is the secret code for {needle.key}? Answer with the code only."

    def render(parts: list[str]) -> list[int]:
        messages = [{"role": "user", "content": "\n\n".join([*parts, question])}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def cost(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    paragraphs = [p.strip() for text in filler for p in text.split("\n\n") if p.strip()]
    budget = length - len(render([fact]))
    start = rng.randrange(len(paragraphs))
    chosen: list[str] = []
    used = 0
    while used < budget:
        paragraph = paragraphs[(start + len(chosen)) % len(paragraphs)]
        spent = cost(paragraph + "\n\n")
        if used + spent <= budget:
            chosen.append(paragraph)
            used += spent
            continue
        lines: list[str] = []
        for line in paragraph.split("\n"):
            spent = cost(line + "\n")
            if used + spent > budget:
                break
            lines.append(line)
            used += spent
        if lines:
            chosen.append("\n".join(lines))
        break
    at = round(depth * len(chosen))
    parts = [*chosen[:at], fact, *chosen[at:]]
    prompt = render(parts)
    while len(prompt) > length and len(parts) > 1:
        last = len(parts) - 1 if parts[-1] is not fact else len(parts) - 2
        kept = parts[last].rsplit("\n", 1)[0] if "\n" in parts[last] else ""
        parts = [*parts[:last], *([kept] if kept else []), *parts[last + 1 :]]
        prompt = render(parts)
    return ChatDocument(prompt, needle.key, needle.value, depth)
