"""The bundled kakeya-tiny family: what it ships, and that it is trained (it retrieves needles, its drafter drafts)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from inference_engine.config import BUNDLED_MODEL_DIR
from kv_cache_proposer.backends import load_verifier
from tests.support.server import create, generate, start_server

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from eval_niah import heldout_lines  # noqa: E402
from lib.niah import build_document  # noqa: E402

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)


@pytest.fixture(scope="module")
def documents(tokenizer):
    """Four needle documents of 1024 tokens over held-out standard-library source, needles at four depths."""
    lines, rng = heldout_lines(tokenizer), random.Random(7)
    return [build_document(lines, tokenizer.encode, 1024, [depth], rng) for depth in (0.0, 0.33, 0.66, 1.0)]


def test_the_family_ships_within_budget_with_a_matching_tokenizer_and_drafter(tokenizer):
    total = sum(f.stat().st_size for f in BUNDLED_MODEL_DIR.rglob("*") if f.is_file())
    assert total <= 20 << 20
    config = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())
    drafter = json.loads((BUNDLED_MODEL_DIR / "dflash" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] in (64, 128)
    assert config["vocab_size"] == len(tokenizer) == drafter["vocab_size"]
    assert drafter["dflash_config"]["mask_token_id"] == tokenizer.convert_tokens_to_ids("<|mask|>")
    text = "def main():\n    return 42  # ünïcode\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n")
    card = json.loads((BUNDLED_MODEL_DIR / "kakeya_model.json").read_text())
    assert card["recipe"]["seq_lens"][-1] >= 2048


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_the_bundled_model_retrieves_needles_with_its_drafter_on_both_backends(backend, tokenizer, documents):
    verifier = load_verifier(backend, BUNDLED_MODEL_DIR, device="cpu", dtype="float32")
    server = start_server(verifier, backend=backend, proposer="dflash")
    try:
        recalled, drafted, accepted = 0, 0, 0
        for document in documents:
            sid = create(server.stub, document.prompt)
            result = generate(server.stub, sid, max_tokens=10)
            assert result.done is not None
            recalled += document.needles[-1].value in tokenizer.decode(result.tokens)
            drafted += result.done.draft_token_count
            accepted += result.done.accepted_draft_token_count
    finally:
        server.stop()
    assert recalled >= 3, f"{recalled}/4 needles recalled on {backend}"
    assert drafted > 0 and accepted > 0, "the bundled drafter drafts through the serving path and is sometimes right"
