"""scripts/bench_structured.py runs its four arms side by side and writes the common results format."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.support.children import run_child

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_compares_constrained_and_unconstrained_generation_with_and_without_a_proposer(tmp_path):
    command = [
        sys.executable,
        "scripts/bench_structured.py",
        "--prompts",
        "1",
        "--max-tokens",
        "48",
        "--repeats",
        "1",
        "--results-dir",
        str(tmp_path / "results"),
    ]
    result = run_child(command, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("bench_structured_*.json")
    assert path.with_suffix(".png").is_file()
    summary = json.loads(path.read_text())["summary"]
    assert set(summary["arms"]) == {
        "none unconstrained",
        "none json_schema",
        "ngram unconstrained",
        "ngram json_schema",
    }
    assert summary["constrained_identical_with_proposer"] is True
    assert summary["grammar_cost"]["tokens"] > 0 and summary["grammar_cost"]["mean_us"] > 0
    assert set(summary["constrained_vs_unconstrained"]) == {"none", "ngram"}
    assert set(summary["paired_decode_ratio_median"]) == {"none", "ngram"}
    assert all(arm["decode_tokens_per_s"] > 0 for arm in summary["arms"].values())
