"""scripts/bench_mlx_backend.py: a smoke run writes the result JSON and plot with the ratios in its summary."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_smoke_run_writes_results_with_the_ratio_of_both_loops(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_mlx_backend", ROOT / "scripts" / "bench_mlx_backend.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0

    (json_path,) = tmp_path.glob("bench_mlx_backend_*.json")
    assert json_path.with_suffix(".png").stat().st_size > 0
    data = json.loads(json_path.read_text())
    assert {"config", "environment", "samples", "summary"} <= data.keys()
    samples, summary = data["samples"], data["summary"]
    assert set(samples) == {"kakeya", "mlx_lm"}
    for runs in samples.values():
        assert len(runs) == data["config"]["repeats"]
        assert all(len(run["tokens"]) == data["config"]["new_tokens"] for run in runs)
    assert summary["tokens_identical"] is True
    medians = {s: statistics.median(r["decode_tokens_per_s"] for r in samples[s]) for s in samples}
    assert summary["decode_tokens_per_s_ratio"] == medians["kakeya"] / medians["mlx_lm"]
    assert f"{summary['decode_tokens_per_s_ratio']:.2f}x" in summary["statement"]
