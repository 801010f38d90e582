"""scripts/eval_weights.py: a smoke run on the bundled model measures every weights choice and both K/V precisions
of a `--kv-arms` choice through the session cache."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.children import run_child

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def test_the_smoke_run_measures_each_choice_and_both_kv_precisions(tmp_path):
    command = [
        sys.executable,
        "scripts/eval_weights.py",
        "--model=kakeya-tiny",
        "--weights",
        "float32",
        "int8",
        "--kv-arms",
        "int8",
        "--context=96",
        "--windows=1",
        "--prompts=1",
        "--agree-tokens=8",
        "--threads=1",
        f"--out={tmp_path}",
    ]
    result = run_child(command, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = tmp_path.glob("eval_weights_*.json")
    assert path.with_suffix(".png").exists()
    summary = json.loads(path.read_text())["summary"]
    assert list(summary) == ["float32", "int8", "int8:kv=model", "int8:kv=bfloat16"]
    for row in summary.values():
        assert row["ppl_prose"] > 1 and row["ppl_code"] > 1
        assert 0 <= row["greedy_agreement"] <= 1
    # the session cache computes what the modules do, up to float rounding; bfloat16 K/V move perplexity a little
    assert summary["int8:kv=model"]["ppl_code"] == pytest.approx(summary["int8"]["ppl_code"], rel=1e-3)
    assert summary["int8:kv=bfloat16"]["ppl_code"] == pytest.approx(summary["int8"]["ppl_code"], rel=0.05)
    assert summary["int8:kv=bfloat16"]["ppl_code"] != summary["int8:kv=model"]["ppl_code"]
