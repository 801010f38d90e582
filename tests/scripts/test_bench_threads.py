"""scripts/bench_threads.py measures the daemon's decode speed per OpenMP wait, thread count and load, and writes the
common results format."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.children import run_child

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_measures_every_wait_and_thread_count_under_every_load(checkpoints, tmp_path):
    command = [
        sys.executable,
        "scripts/bench_threads.py",
        "--model",
        str(checkpoints["qwen3"]),
        "--threads",
        "1",
        "2",
        "--busy",
        "0",
        "1",
        "--waits",
        "spin",
        "passive",
        "--history-tokens",
        "8",
        "--max-tokens",
        "4",
        "--repeats",
        "1",
        "--results-dir",
        str(tmp_path),
    ]
    result = run_child(command, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip().splitlines()[-1])
    payload = json.loads(path.read_text())
    assert path.with_suffix(".png").is_file()
    triples = {(s["busy"], s["wait"], s["threads"]) for s in payload["samples"]}
    assert triples == {(b, w, t) for b in (0, 1) for w in ("spin", "passive") for t in (1, 2)}
    assert all(s["tokens_per_s"] > 0 for s in payload["samples"])
    arms = payload["summary"]["by_busy_processes"]
    assert set(arms) == {"busy_0", "busy_1"}
    for arm in arms.values():
        assert set(arm["tokens_per_s"]) == {"spin", "passive"}
        spin, passive = arm["tokens_per_s"]["spin"], arm["tokens_per_s"]["passive"]
        assert arm["over_passive"]["spin"] == {t: round(spin[t] / passive[t], 3) for t in ("1", "2")}
    assert payload["environment"]["waits"]["spin"]["OMP_WAIT_POLICY"] == "ACTIVE"
