"""scripts/bench_invariance.py delivers held-out histories to a daemon in every shape and compares the tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.children import run_child

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("forward", ["auto", "fast"])
def test_the_invariance_report_delivers_every_shape_and_counts_mismatches(tmp_path, forward):
    command = [
        sys.executable,
        "scripts/bench_invariance.py",
        "--histories",
        "3",
        "--history-tokens",
        "560",
        "--new-tokens",
        "6",
        "--turn-tokens",
        "300",
        "7",
        "--token-tail",
        "5",
        "--batch-others",
        "2",
        "--logprobs",
        "--flags",
        f"--torch-forward {forward}",
        "--results-dir",
        str(tmp_path),
    ]
    result = run_child(command, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    (path,) = tmp_path.glob("bench_invariance_*.json")
    assert path.with_suffix(".png").is_file()
    body = json.loads(path.read_text())
    shapes = {"fork", "turns of 300", "turns of 7", "token by token", "among 2", "journal"}
    assert set(body["samples"]) == shapes
    assert all(len(rows) == 3 for rows in body["samples"].values())
    summary = body["summary"]
    assert summary["comparisons"] == 3 * len(shapes)
    assert summary["total_mismatches"] == sum(summary["mismatches"].values())
    if forward == "auto":  # the default forward's contract: identical values whatever the shape
        assert summary["total_mismatches"] == 0, summary["mismatches"]
    else:  # the fast kernels' last bits depend on the block's shape, which the log-probabilities show
        assert summary["mismatches"]["among 2"] > 0
