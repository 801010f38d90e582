"""scripts/bench_memory.py: one daemon per KV arm; a generating session's reported bytes, the daemon's RSS and the
decode speed, with ratios to `full`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    path = ROOT / "scripts" / "bench_memory.py"
    spec = importlib.util.spec_from_file_location("bench_memory", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_a_smoke_run_measures_every_arm_against_full(tmp_path):
    bench = _bench()
    argv = ["--histories", "300,600", "--arms", "full,kakeya_d4", "--new-tokens", "4", "--repeats", "1"]
    assert bench.main([*argv, "--out", str(tmp_path)]) == 0

    (json_path,) = tmp_path.glob("bench_memory_*.json")
    assert json_path.with_suffix(".png").stat().st_size > 0
    data = json.loads(json_path.read_text())
    samples, arms = data["samples"], data["summary"]["arms"]
    assert {(s["arm"], s["history"]) for s in samples} == {(a, h) for a in ("full", "kakeya_d4") for h in (300, 600)}
    assert all(len(s["tokens"]) == 4 and s["byte_samples"] > 0 and s["peak_rss_bytes"] > 0 for s in samples)
    assert all(s["next_turn_ttft_s"] > 0 for s in samples)
    assert all(1 <= s["verifier_forwards"] <= len(s["tokens"]) for s in samples)  # a forward gives 1 token or more
    for history in ("300", "600"):
        full, packed = arms["full"][history], arms["kakeya_d4"][history]
        assert full["peak_vs_full"] == 1.0 and full["tokens_equal_full"] is True
        assert full["forward_rate_vs_full"] == 1.0 and packed["forward_rate_vs_full"] > 0
        assert packed["tokens_per_forward"] >= 1
        # Sampled while generating: the generating session held more than it holds parked, and a packed one less
        # than a dense one.
        assert packed["peak_session_bytes"] > packed["parked_session_bytes"]
        assert packed["peak_session_bytes"] < full["peak_session_bytes"]
        # Prefilled, a packed session held its forwards' staged blocks dense: more than a fork of it holds parked.
        assert full["prefill_peak_vs_full"] == 1.0 and full["prefill_peak_bytes"] > 0
        assert packed["prefill_peak_bytes"] > packed["parked_session_bytes"]
    assert data["summary"]["exact_arms_equal_full"] == {"full": True}


def test_the_arms_must_include_full():
    with pytest.raises(SystemExit):
        _bench().parse_args(["--arms", "kakeya_d4"])
