"""scripts/bench_kv_quality.py: a smoke run on the bundled model writes every arm's rate and distortion."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.children import run_child

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def test_the_smoke_run_measures_every_arm_and_places_the_lattice_against_the_field(tmp_path):
    command = [
        sys.executable,
        "scripts/bench_kv_quality.py",
        "--model=kakeya-tiny",
        "--formats=none,kakeya_d4:38,q4_0,q8_0_rot,affine4_g64",
        "--contexts=128",
        "--needles=2",
        "--needle-kind=code",
        "--needle-tokens=200",
        "--agree-prompts=1",
        "--agree-tokens=8",
        "--answer-tokens=6",
        "--mlx-bits=4",
        "--mlx-chunk=64",
        "--threads=1",
        f"--out={tmp_path}",
    ]
    result = run_child(command, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = tmp_path.glob("bench_kv_quality_*.json")
    assert path.with_suffix(".png").exists()
    payload = json.loads(path.read_text())
    rows = payload["summary"]["formats"]
    assert set(rows) == {"none", "kakeya_d4:38", "q4_0", "q8_0_rot", "affine4_g64", "mlx_lm_kv4"}
    assert rows["none"]["dppl_pct_mean"] == 0 and rows["none"]["kl_mean"] == 0
    assert rows["none"]["greedy_agreement"] == 1.0
    assert rows["kakeya_d4:38"]["bits_per_value"] >= 6.75 and rows["q4_0"]["bits_per_value"] == 4.5
    # Measured, not assumed: every lossy arm moves the distribution, 4-bit more than 8-bit.
    assert all(rows[name]["kl_mean"] > 0 for name in ("kakeya_d4:38", "q4_0", "q8_0_rot", "mlx_lm_kv4"))
    assert rows["q4_0"]["kl_mean"] > rows["q8_0_rot"]["kl_mean"]
    assert {"prose@128", "code@128", "chat@128"} <= set(payload["config"]["windows"])
    assert all(0 <= rows[name]["needle_recall"] <= 1 for name in rows if name != "mlx_lm_kv4")
    assert any("kakeya_d4:38" in line for line in payload["summary"]["verdicts"])
