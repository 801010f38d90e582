"""Needle documents (scripts/lib/niah.py) and the NIAH harness (scripts/eval_niah.py) on a live daemon; the
bundled model's recall under every arm that holds a history in less memory, on both backends; the default model's
recall of a fact in a chat document."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from tests.support.children import run_child

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from lib.corpus import manual_sections  # noqa: E402
from lib.niah import build_chat_document, build_document  # noqa: E402

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

WORDS = {i: f"w{i} " for i in range(50)}


def encode(text: str) -> list[int]:
    """A toy tokenizer: one token per character, offset so filler ids (< 1000) never collide."""
    return [1000 + ord(c) for c in text]


FILLER = [[i % 50] * 7 for i in range(300)]


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_a_document_has_the_asked_length_and_its_needle_at_the_asked_depth(depth):
    doc = build_document(FILLER, encode, 600, [depth], random.Random(0))
    assert len(doc.prompt) + len(doc.answer) == 600
    fact = encode(doc.needles[0].fact())
    text = doc.prompt
    at = next(i for i in range(len(text)) if text[i : i + len(fact)] == fact)
    filler_before = sum(1 for t in text[:at] if t < 1000)
    filler_total = sum(1 for t in text if t < 1000)
    assert abs(filler_before / filler_total - depth) < 0.05
    assert doc.answer == encode(doc.needles[0].answer())
    assert doc.prompt[-len(encode(doc.needles[0].question())) :] == encode(doc.needles[0].question())


def test_several_needles_are_each_asked_and_answered_with_their_spans():
    doc = build_document(FILLER, encode, 800, [0.2, 0.2, 0.9], random.Random(1))
    tokens = doc.prompt + doc.answer
    assert len(doc.answer_spans) == 3
    for needle, (start, end) in zip(doc.needles, doc.answer_spans, strict=True):
        assert tokens[start:end] == encode(needle.answer())
        assert encode(needle.fact()) != [] and needle.value in needle.fact()


@pytest.fixture(scope="module")
def chat_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)


@pytest.mark.parametrize(("length", "depth"), [(300, 0.0), (1500, 0.5), (4000, 1.0)])
def test_a_chat_document_fills_its_length_and_asks_for_its_fact_in_the_user_turn(chat_tokenizer, length, depth):
    filler = [text for _, text in manual_sections()]
    doc = build_chat_document(chat_tokenizer, filler, length, depth, random.Random(length))
    assert length - 60 <= len(doc.prompt) <= length
    text = chat_tokenizer.decode(doc.prompt)
    fact = f"The secret code for {doc.key} is {doc.value}."
    question = f"What is the secret code for {doc.key}? Answer with the code only."
    assert text.count(fact) == 1 and text.count(doc.value) == 1
    user = text[text.index("<|im_start|>user") : text.index("<|im_end|>", text.index("<|im_start|>user"))]
    assert fact in user and user.rstrip().endswith(question)
    assert text.endswith("<|im_start|>assistant\n")
    paragraphs = user[len("<|im_start|>user\n") : user.index(question)].strip().split("\n\n")
    assert len(paragraphs) > 2 and abs(paragraphs.index(fact) / (len(paragraphs) - 1) - depth) <= 1.5 / len(paragraphs)


def test_a_restoration_probe_of_chat_documents_asks_each_fact_at_each_length_and_depth(chat_tokenizer):
    from lib.restoration import make_probe

    lengths = (400, 900)
    probe = make_probe(chat_tokenizer, lengths=lengths, samples=3, texts=1, sink=4, window=64, seed=2, chat=True)
    assert len(probe.documents) == 6 and probe.max_tokens == 32, "one document per length and depth"
    for index, doc in enumerate(probe.documents):
        text = chat_tokenizer.decode(doc.prompt)
        assert lengths[index // 3] - 60 <= len(doc.prompt) <= lengths[index // 3]
        assert text.count(f"is {doc.value}.") == 1 and text.endswith("<|im_start|>assistant\n")
    code = make_probe(chat_tokenizer, lengths=(400,), samples=2, texts=1, sink=4, window=64, seed=2)
    assert code.max_tokens == 10 and "<|im_start|>" not in chat_tokenizer.decode(code.documents[0].prompt)


def _harness(tmp_path: Path, *args: str) -> dict:
    """Run scripts/eval_niah.py with `args`, writing into `tmp_path`; its results JSON."""
    result = run_child([sys.executable, "scripts/eval_niah.py", *args, "--results-dir", str(tmp_path)], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = tmp_path.glob("eval_niah_*.json")
    assert path.with_suffix(".png").is_file()
    return json.loads(path.read_text())


def _by_arm(samples: list[dict]) -> dict[str, list[dict]]:
    by_arm: dict[str, list[dict]] = {}
    for sample in samples:
        by_arm.setdefault(sample["kv_strategy"], []).append(sample)
    return by_arm


def test_the_harness_writes_recall_per_strategy_length_and_depth(tmp_path):
    payload = _harness(
        tmp_path, "--lengths", "128,192", "--depths", "2", "--samples", "2", "--window", "48", "--max-tokens", "4"
    )
    summary = payload["summary"]
    assert set(summary["recall"]) == {"full", "sink_window"}
    assert all(0.0 <= v <= 1.0 for rungs in summary["recall"].values() for v in rungs.values())
    assert summary["samples_per_rung"] == {f"{s}/{n}": 2 for s in ("full", "sink_window") for n in (128, 192)}
    assert set(summary["recall_by_depth"]["full"]["128"]) == {"0.00", "1.00"}
    recalled = [s for s in payload["samples"] if s["recalled"]]
    assert all(s["value"] in s["output"] for s in recalled)


ARMS = ("full", "full@kakeya_d4", "dlm_restore:recompute", "dlm_restore:model", "dlm_restore:recompute@kakeya_d4")


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_the_bundled_models_recall_is_unchanged_under_every_memory_arm(tmp_path, backend):
    # Documents of 512 and 1,024 tokens against a window of 128: the needle leaves the window in most of them, so
    # the restoring and compressed arms must hand it back; `sink_window` shows that it left.
    arms = ",".join([*ARMS, "sink_window"])
    payload = _harness(
        tmp_path, f"--serve-flag=--backend={backend}", "--lengths", "512,1024", "--depths", "3", "--samples", "3",
        "--window", "128", "--kv-strategies", arms,
    )  # fmt: skip
    by_arm = _by_arm(payload["samples"])
    full = by_arm["full"]
    assert len(full) == 6 and all(s["recalled"] for s in full)
    for arm in ARMS[1:]:
        mine = by_arm[arm]
        assert [(s["length"], s["key"]) for s in mine] == [(s["length"], s["key"]) for s in full]
        assert [s["recalled"] for s in mine] == [True] * 6, arm
        assert all(s["evicted_tokens"] > 0 for s in mine) or not arm.startswith("dlm_restore"), arm
    # The exact reference restores the very K/V `full` holds: the same tokens, not only the same recall.
    assert [s["output"] for s in by_arm["dlm_restore:recompute"]] == [s["output"] for s in full]
    assert sum(s["recalled"] for s in by_arm["sink_window"]) < len(full)


def test_the_default_model_recalls_a_fact_from_a_chat_document_and_restoring_gives_full_s_answers(tmp_path):
    # Chat documents of 1,024 tokens against a window of 64: `full` reads the fact and answers it; `sink_window`
    # keeps neither the fact nor most of the document; `recompute` restores every evicted position exactly.
    payload = _harness(
        tmp_path, "--model", "smollm2-135m-instruct", "--documents", "chat", "--lengths", "1024", "--depths", "3",
        "--samples", "3", "--window", "64", "--kv-strategies", "full,sink_window,dlm_restore:recompute",
    )  # fmt: skip
    assert payload["config"]["documents"] == "chat" and payload["config"]["max_tokens"] == 32
    by_arm = _by_arm(payload["samples"])
    assert all(1024 - 60 <= s["prompt_tokens"] <= 1024 for s in payload["samples"])
    full = by_arm["full"]
    assert sum(s["recalled"] for s in full) >= 2, [s["output"] for s in full]
    assert sum(s["recalled"] for s in by_arm["sink_window"]) < sum(s["recalled"] for s in full)
    assert [s["output"] for s in by_arm["dlm_restore:recompute"]] == [s["output"] for s in full]
    assert all(s["evicted_tokens"] > 0 for s in by_arm["dlm_restore:recompute"])
