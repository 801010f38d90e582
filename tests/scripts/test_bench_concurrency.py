"""scripts/bench_concurrency.py drives a batched and an unbatched daemon side by side and writes the common results
format."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.children import run_child

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def test_the_concurrency_benchmark_compares_batched_with_unbatched_and_alone_decoding(tmp_path):
    command = [
        sys.executable,
        "scripts/bench_concurrency.py",
        "--sessions",
        "1",
        "3",
        "--max-tokens",
        "6",
        "--history-tokens",
        "30",
        "90",
        "--rounds",
        "1",
        "--batch-size",
        "4",
        "--results-dir",
        str(tmp_path),
    ]
    result = run_child(command, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    (path,) = tmp_path.glob("bench_concurrency_*.json")
    assert path.with_suffix(".png").is_file()
    body = json.loads(path.read_text())
    summary = body["summary"]
    assert summary["session_token_mismatches"] == 0, "greedy tokens must not depend on batching"
    assert summary["session_token_mismatches_vs_alone"] == 0
    assert sorted(summary["history_lengths"]) == [30, 60, 90]
    for mode in ("batched", "unbatched", "alone"):
        configurations = summary[mode]["configurations"]
        assert [c["sessions"] for c in configurations] == [1, 3]
        assert [c["tokens"] for c in configurations] == [6, 18]
        assert all(c["aggregate_tokens_per_s"] > 0 for c in configurations)
        assert all(c["inter_token_p99_s"] >= c["inter_token_p50_s"] > 0 for c in configurations)
        assert set(summary[mode]["scaling_vs_first"]) == {"1", "3"}
    assert set(summary["batched_over_unbatched"]) == set(summary["batched_over_alone"]) == {"1", "3"}
    assert set(body["samples"]) == {"batched", "unbatched", "alone"}


def test_the_concurrency_benchmark_runs_the_dflash_proposer_in_both_modes(tmp_path):
    command = [
        sys.executable,
        "scripts/bench_concurrency.py",
        "--sessions",
        "2",
        "--max-tokens",
        "8",
        "--prompt-tokens",
        "8",
        "--rounds",
        "1",
        "--batch-size",
        "4",
        "--proposer",
        "dflash",
        "--results-dir",
        str(tmp_path),
    ]
    result = run_child(command, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    (path,) = tmp_path.glob("bench_concurrency_*.json")
    body = json.loads(path.read_text())
    assert body["config"]["proposer"] == "dflash"
    assert body["summary"]["session_token_mismatches"] == 0, "greedy tokens must not depend on batched drafting"
    assert [c["tokens"] for c in body["summary"]["batched"]["configurations"]] == [16]
