"""scripts/bench_load.py drives real daemons with and without --state-dir and writes the common results format."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.children import run_child

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def test_the_load_benchmark_compares_the_journal_with_memory_only_and_checks_every_history(tmp_path):
    command = [
        sys.executable,
        "scripts/bench_load.py",
        "--sessions",
        "3",
        "--turns",
        "2",
        "--max-tokens",
        "2",
        "--max-concurrent",
        "1",
        "2",
        "--journal-writes",
        "20",
        "--results-dir",
        str(tmp_path),
    ]
    result = run_child(command, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    (path,) = tmp_path.glob("bench_load_*.json")
    assert path.with_suffix(".png").is_file()
    body = json.loads(path.read_text())
    summary = body["summary"]
    assert summary["total_errors"] == 0 and summary["total_history_mismatches"] == 0
    assert summary["kv_live_bytes_after_close_max"] == 0
    configurations = summary["configurations"]
    assert [(c["max_concurrent"], c["journal"]) for c in configurations] == [
        (1, False),
        (1, True),
        (2, False),
        (2, True),
    ]
    assert all(c["turns"] == 6 and c["turn_latency_p99_s"] >= c["turn_latency_p50_s"] > 0 for c in configurations)
    assert set(summary["journal_p50_latency_ratio"]) == {"1", "2"}
    assert [j["sync"] for j in summary["journal_alone"]] == ["normal", "full"]
    assert all(j["commit_p99_s"] >= j["commit_p50_s"] > 0 for j in summary["journal_alone"])
    assert len(body["samples"]) == 4
