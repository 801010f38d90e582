"""scripts/bench_speculative.py runs every arm side by side and writes the common results format."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.checkpoints import save_dflash_drafter, save_draft_model
from tests.support.children import run_child

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_compares_every_proposer_on_the_same_prompts(checkpoints, tmp_path):
    import numpy as np

    corpus = tmp_path / "corpus.npy"
    np.save(corpus, np.arange(200) % 120)
    command = [
        sys.executable,
        "scripts/bench_speculative.py",
        "--model",
        str(checkpoints["qwen3"]),
        "--dflash",
        str(save_dflash_drafter(tmp_path / "dflash")),
        "--draft-model",
        str(save_draft_model(tmp_path / "draft")),
        "--corpus",
        str(corpus),
        "--prompts",
        "2",
        "--prompt-tokens",
        "24",
        "--max-tokens",
        "12",
        "--repeats",
        "1",
        "--results-dir",
        str(tmp_path / "results"),
    ]
    result = run_child(command, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("bench_speculative_*.json")
    payload = json.loads(path.read_text())
    proposers = payload["summary"]["proposers"]
    speculative = ("ngram", "draft_model", "dflash")
    assert set(proposers) == {
        "none",
        *speculative,
        *(f"{name}/{p}" for name in speculative for p in ("adaptive", "cost")),
    }
    assert all(arm["identical_to_none"] for arm in proposers.values())
    assert all(proposers[name]["propose_ms"] > 0 and proposers[name]["verify_ms"] > 0 for name in speculative)
    assert payload["config"]["prompt_files"] == [str(corpus)]
    assert set(payload["summary"]["speedup_vs_none"]) == set(proposers)
    assert proposers["ngram"]["verifier_forwards_per_token"] < 1.0, "the prompt repeats: lookup drafts get accepted"
    assert path.with_suffix(".png").is_file()
    assert len(payload["samples"]["dflash"]) == 2


def test_draft_layers_cuts_the_verifier_into_a_draft_model(checkpoints, tmp_path):
    import numpy as np

    corpus = tmp_path / "corpus.npy"
    np.save(corpus, np.arange(100) % 60)
    common = [sys.executable, "scripts/bench_speculative.py", "--model", str(checkpoints["qwen3"])]
    small = ["--corpus", str(corpus), "--prompts", "1", "--prompt-tokens", "16", "--max-tokens", "8", "--repeats", "1"]
    small += ["--draft-policies", "full", "adaptive"]
    result = run_child([*common, *small, "--draft-layers", "1", "--results-dir", str(tmp_path / "results")], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("bench_speculative_*.json")
    proposers = json.loads(path.read_text())["summary"]["proposers"]
    assert set(proposers) == {"none", "ngram", "draft_model", "ngram/adaptive", "draft_model/adaptive"}
    assert proposers["draft_model"]["identical_to_none"] and proposers["draft_model"]["draft_acceptance_rate"] > 0
    too_deep = run_child([*common, *small, "--draft-layers", "9"], cwd=ROOT)
    assert too_deep.returncode != 0 and "--draft-layers must be in" in too_deep.stderr
