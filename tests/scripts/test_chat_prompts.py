"""The drafter's chat prompts: every kind in the model's own chat template, ending at the assistant's turn, cut from
the corpus files it is given (training or held-out, never both), documents near the length asked for, seeded."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from lib.chat_prompts import KINDS, ChatPromptBuilder, chat_prompts, definitions  # noqa: E402
from lib.corpus import split_sources, stdlib_sources  # noqa: E402

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)


@pytest.fixture(scope="module")
def corpus():
    train, held = split_sources(stdlib_sources())
    return train[:60], held[:20]


def test_every_kind_is_a_chat_ending_at_the_assistants_turn_from_its_own_files(tokenizer, corpus):
    train, held = corpus
    builder = ChatPromptBuilder(tokenizer, held)
    counts = dict.fromkeys(KINDS, 3)
    prompts = chat_prompts(builder, counts, seed=1, document_range=(300, 900))
    assert [p.kind for p in prompts] == [kind for kind in KINDS for _ in range(3)]
    held_names = {d.name for path in held for d in definitions(path)}
    train_only = {d.name for path in train for d in definitions(path)} - held_names
    for prompt in prompts:
        text = tokenizer.decode(prompt.tokens)
        assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n"), prompt.kind
        assert not any(f"`{name}`" in text for name in train_only if len(name) > 12), "held-out files only"
    documents = [p for p in prompts if p.kind == "document"]
    assert all(250 <= len(p.tokens) <= 1000 for p in documents)
    tools = [p for p in prompts if p.kind == "tool_call"]
    assert all('"parameters"' in tokenizer.decode(p.tokens) for p in tools)
    again = chat_prompts(ChatPromptBuilder(tokenizer, held), counts, seed=1, document_range=(300, 900))
    assert [p.tokens for p in again] == [p.tokens for p in prompts], "seeded"


def test_a_document_prompt_grows_with_the_length_asked_for(tokenizer, corpus):
    builder = ChatPromptBuilder(tokenizer, corpus[0])
    short = builder.build("document", random.Random(4), length=200)
    long = builder.build("document", random.Random(4), length=3000)
    assert len(short.tokens) < 400 < 2500 < len(long.tokens) <= 3200
    with pytest.raises(ValueError, match="unknown prompt kind"):
        builder.build("poem", random.Random(0))


def test_the_prompt_file_script_writes_training_and_held_out_slices(tmp_path):
    from lib.prompt_rows import PromptSet

    from tests.support.children import run_child

    out = tmp_path / "prompts.npz"
    command = [sys.executable, "scripts/make_drafter_prompts.py", "--out", str(out), "--slices", "6", "--held", "3"]
    run = run_child([*command, "--slice-lengths", "16", "100"], cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    prompts = PromptSet.load(out)
    assert len(prompts.train) == 6 and len(prompts.held) == 3 and set(prompts.train_kinds) == {"slice"}
    assert all(16 <= len(p) <= 100 for p in prompts.train + prompts.held)
    bad = run_child([*command, "--slice-lengths", "50", "10"], cwd=ROOT)
    assert bad.returncode != 0 and "1 <= MIN <= MAX" in bad.stderr
