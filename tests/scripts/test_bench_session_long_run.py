"""Smoke runs of scripts/bench_agentic/bench_session_long_run.py and its summary arithmetic."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.children import run_child

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_agentic" / "bench_session_long_run.py"
TINY = ["--turns", "4", "--buckets", "2", "--initial-tokens", "12", "--user-tokens-per-turn", "4", "--max-tokens", "3"]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_session_long_run", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> dict:
    result = run_child([sys.executable, str(SCRIPT), *args])
    assert result.returncode == 0, result.stdout + result.stderr
    out = Path(args[args.index("--out") + 1])
    [report] = out.glob("bench_session_long_run_*.json")
    assert (out / report.name.replace(".json", ".png")).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(report.read_text())


def test_a_tiny_run_on_its_own_daemon_writes_samples_buckets_summary_and_plot(tmp_path):
    report = _run(*TINY, "--window", "8", "--sink", "2", "--out", str(tmp_path), "--quiet")
    samples = report["samples"]
    assert [s["arm"] for s in samples].count("session") == 4 and [s["arm"] for s in samples].count("baseline") == 4
    session = [s for s in samples if s["arm"] == "session"]
    assert [s["history_length"] for s in session] == [12 + 7 * (t + 1) for t in range(4)]
    assert all(s["resident_tokens"] == 10 and s["evicted_tokens"] > 0 for s in session)
    summary = report["summary"]
    assert summary["turns"] == 4 and summary["final_history_length"] == 40 and summary["buckets"] == 2
    assert summary["invariant_violations"] == 0 and summary["checks"]["zero_invariant_violations"]
    assert summary["baseline_token_agreement"] == 1.0, "a fresh session given the history continues identically"
    assert summary["baseline_over_session_latency_p50_last_bucket"] > 0
    assert report["config"]["kv_strategy"] == "sink_window" and report["environment"]["daemon_command"]
    assert report["config"]["model_name"] == "kakeya-tiny"


def test_a_run_against_a_running_daemon_uses_it(serve, tmp_path):
    server = serve("qwen3")
    args = [*TINY, "--kv-strategy", "full", "--token-id-limit", "128", "--baseline-every", "3"]
    report = _run(*args, "--address", server.address, "--out", str(tmp_path), "--quiet")
    assert report["environment"]["daemon_command"] is None
    assert report["config"]["model_name"] is None, "the running daemon's model, whatever --model says"
    assert [s["turn"] for s in report["samples"] if s["arm"] == "baseline"] == [0, 3]
    assert server.runtime.store.sessions() == [], "every session the run created was closed"


def test_a_duration_limit_ends_the_run_after_the_turn_that_reaches_it(serve, tmp_path):
    server = serve("qwen3")
    args = ["--turns", "50", "--duration-s", "0.001", "--initial-tokens", "4", "--token-id-limit", "128"]
    report = _run(*args, "--address", server.address, "--out", str(tmp_path), "--quiet")
    assert report["summary"]["turns"] == 1 and report["summary"]["baseline_turns"] == 1


def test_buckets_and_summary_follow_their_definitions():
    bench = _load()

    def sample(arm: str, turn: int, wall: float, kv: int) -> object:
        return bench.Sample(arm, turn, wall, 0.0, 1, 1, 10 * (turn + 1), kv, 5, 0, 0, 0, arm == "baseline" or None)

    samples = [sample("session", t, 1.0 + t, 100 + t) for t in range(4)]
    samples += [sample("baseline", t, 10.0 * (t + 1), 100) for t in range(4)]
    rows = bench.buckets(samples, 2)
    assert [(r["first_turn"], r["last_turn"]) for r in rows] == [(0, 1), (2, 3)]
    assert rows[0]["session"]["wall_s_p50"] == 1.5 and rows[1]["session"]["wall_s_p50"] == 3.5
    assert rows[1]["baseline"]["wall_s_p95"] == 39.5
    summary = bench.summarize(samples, rows)
    assert summary["latency_p50_drift"] == 3.5 / 1.5
    assert summary["kv_drift"] == (102.5 - 100.5) / 100.5
    assert summary["baseline_over_session_latency_p50_last_bucket"] == 35.0 / 3.5
    assert summary["checks"] == {
        "kv_drift_below_10_percent": True,
        "latency_p50_drift_at_most_1_5": False,
        "zero_invariant_violations": True,
    }
