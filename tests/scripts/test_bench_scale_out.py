"""scripts/bench_scale_out.py runs PostgreSQL, daemons and HAProxy on loopback and writes the common results format."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.children import run_child
from tests.support.postgres import haproxy_binary, postgres_bin_dir

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def test_the_scale_out_benchmark_measures_throughput_per_daemon_count_and_the_resume_after_a_kill(tmp_path):
    if postgres_bin_dir() is None or haproxy_binary() is None:
        pytest.skip("PostgreSQL and HAProxy are not installed: scripts/install_system_packages.sh installs them")
    command = [
        sys.executable,
        "scripts/bench_scale_out.py",
        *("--daemons", "1", "2", "--clients", "2", "--duration-s", "2"),
        *("--resume-sessions", "4", "--resume-history-tokens", "32", "--results-dir", str(tmp_path)),
    ]
    result = run_child(command, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    (path,) = tmp_path.glob("bench_scale_out_*.json")
    assert path.with_suffix(".png").is_file()
    summary = json.loads(path.read_text())["summary"]
    assert summary["total_errors"] == 0 and summary["total_history_mismatches"] == 0
    assert [r["daemons"] for r in summary["throughput"]] == [1, 2]
    assert all(r["turns"] > 0 and r["turns_per_s"] > 0 for r in summary["throughput"])
    assert sum(summary["throughput"][1]["sessions_per_daemon"].values()) == 2
    resume = summary["resume"]
    assert resume["daemons"] == 2 and resume["moved_sessions"] >= 1
    assert resume["takeovers"] == resume["moved_sessions"]
    assert resume["resume_turn_first_token_p50_s"] > 0
