"""scripts/bench_speculative.py runs every arm side by side and writes the common results format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.checkpoints import save_dflash_drafter, save_draft_model

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
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("bench_speculative_*.json")
    payload = json.loads(path.read_text())
    proposers = payload["summary"]["proposers"]
    assert set(proposers) == {"none", "ngram", "draft_model", "dflash"}
    assert all(arm["identical_to_none"] for arm in proposers.values())
    assert set(payload["summary"]["speedup_vs_none"]) == set(proposers)
    assert proposers["ngram"]["verifier_forwards_per_token"] < 1.0, "the prompt repeats: lookup drafts get accepted"
    assert path.with_suffix(".png").is_file()
    assert len(payload["samples"]["dflash"]) == 2
