"""scripts/bench_kv_compression.py: a smoke run writes the common results format with every part measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.children import run_child

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def test_the_smoke_run_writes_rate_distortion_daemon_and_budget_results(tmp_path):
    out = tmp_path / "results"
    command = [sys.executable, "scripts/bench_kv_compression.py", "--smoke", "--results-dir", str(out)]
    result = run_child(command, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = out.glob("bench_kv_compression_*.json")
    assert path.with_suffix(".png").exists()
    payload = json.loads(path.read_text())
    summary = payload["summary"]
    methods = {row["method"] for row in payload["samples"]["rate_distortion"]}
    assert {"kakeya_d4", "kakeya_e8", "affine4_g64", "affine8_g64", "fp8_e4m3", "bf16"} <= methods
    variants = summary["variants"]
    assert set(variants) == {"none", "kakeya_d4:38"}
    packed = variants["kakeya_d4:38"]
    # Measured, not assumed: the packed session holds fewer bytes per token than the dense one.
    assert packed["bytes_per_token"] < variants["none"]["bytes_per_token"]
    assert packed["sessions_held_under_budget"] >= variants["none"]["sessions_held_under_budget"] >= 1
    assert set(packed["niah_recall"]) == {"128"} and set(packed["niah_discordant_with_none"]) == {"128"}
    # Part 3 reports what it measured next to what the session bytes predict.
    budget = packed["budget"]
    assert budget["session_bytes"] < variants["none"]["budget"]["session_bytes"]
    # Parked sessions beside the one generating at its peak (the budget charges a generating session all it holds).
    expected = (summary["kv_budget_bytes"] - budget["generating_peak_bytes"]) // budget["session_bytes"] + 1
    assert budget["expected_held"] == expected and budget["generating_peak_bytes"] > budget["session_bytes"]
    assert budget["byte_ratio_vs_none"] > 1
    # Decode speed: interleaved rounds of every variant, wall clock and the daemon's CPU time per token.
    speed = payload["samples"]["decode_speed"]
    assert set(speed) == {"none", "kakeya_d4:38"} and all(len(v["rounds"]) == 1 for v in speed.values())
    assert packed["decode_speed_vs_none"] > 0
    assert packed["decode_cpu_s_per_token"] is not None or not sys.platform.startswith("linux")  # /proc only
    assert summary["duration_s"]["total"] > 0
    assert len(summary["lattice_vs_affine4"]) == 4
