"""scripts/bench_budget_load.py: sessions generating at once under one KV budget; errors, consistency, the budget."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    path = ROOT / "scripts" / "bench_budget_load.py"
    spec = importlib.util.spec_from_file_location("bench_budget_load", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize(("budget", "concurrency", "evicts"), [(1 << 30, 2, False), (1_000_000, 1, True)])
def test_a_smoke_run_reports_errors_consistency_and_the_budget(tmp_path, budget, concurrency, evicts):
    bench = _bench()
    argv = ["--sessions", "6", "--concurrency", str(concurrency), "--history", "300", "--new-tokens", "4"]
    assert bench.main([*argv, "--budget-bytes", str(budget), "--out", str(tmp_path)]) == 0

    (json_path,) = tmp_path.glob("bench_budget_load_*.json")
    assert json_path.with_suffix(".png").stat().st_size > 0
    data = json.loads(json_path.read_text())
    summary, states = data["summary"], data["samples"]["states"]
    assert summary["errors"] == 0 and summary["inconsistent"] == []
    assert summary["consistent"] + summary["evicted"] == 6 and set(states) <= {"consistent", "evicted"}
    # 1 MB: one generating session (charged about 0.63 MB as its 300-token prefill forward ends, one layer's dense
    # stage beside the block's coding) and two parked ones (0.13 MB each), not six.
    assert (summary["evicted"] > 0) is evicts
    assert summary["samples"] > 0 and summary["max_held_bytes"] > 0
    assert all(len(s["tokens"]) == 4 for s in data["samples"]["sessions"])
