"""scripts/bench_engine_revisions.py: a smoke run compares two revisions and writes results with their ratios."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    path = ROOT / "scripts" / "bench_engine_revisions.py"
    spec = importlib.util.spec_from_file_location("bench_engine_revisions", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_a_smoke_run_of_two_revisions_writes_results_with_their_ratios(tmp_path):
    bench = _bench()
    assert bench.main(["--baseline", "HEAD", "--smoke", "--backends", "torch", "--out", str(tmp_path)]) == 0

    (json_path,) = tmp_path.glob("bench_engine_revisions_*.json")
    assert json_path.with_suffix(".png").stat().st_size > 0
    data = json.loads(json_path.read_text())
    engines = data["environment"]["engines"]
    assert engines["current/torch"] == str(ROOT / "kv_cache_proposer")
    assert engines["baseline/torch"] != engines["current/torch"], "the baseline runs from its own exported tree"
    samples, summary = data["samples"], data["summary"]
    assert set(samples) == {f"{rev}/torch/{s}" for rev in ("baseline", "current") for s in ("full", "sink_window")}
    assert summary["tokens_identical"] is True, "HEAD and the working tree decode the same tokens"
    for arm in ("torch/full", "torch/sink_window"):
        medians = {
            rev: statistics.median(r["decode_tokens_per_s"] for r in samples[f"{rev}/{arm}"])
            for rev in ("baseline", "current")
        }
        assert summary["decode_tokens_per_s_ratio"][arm] == medians["current"] / medians["baseline"]


def test_an_unknown_baseline_revision_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown revision"):
        _bench().main(["--baseline", "no-such-revision", "--smoke", "--out", str(tmp_path)])
