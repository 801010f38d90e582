"""scripts/bench_daemon_revisions.py: two daemons, one per revision, prefill and decode side by side; results with
ratios."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    path = ROOT / "scripts" / "bench_daemon_revisions.py"
    spec = importlib.util.spec_from_file_location("bench_daemon_revisions", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_a_smoke_run_decodes_through_both_revisions_daemons_and_writes_their_ratios(tmp_path):
    bench = _bench()
    argv = ["--baseline", "HEAD", "--histories", "16,24", "--new-tokens", "4", "--repeats", "2", "--out", str(tmp_path)]
    argv += ["--prefill-repeats", "2", "--current-env", "KAKEYA_DENSE_ATTENTION=flash"]
    assert bench.main(argv) == 0

    (json_path,) = tmp_path.glob("bench_daemon_revisions_*.json")
    assert json_path.with_suffix(".png").stat().st_size > 0
    data = json.loads(json_path.read_text())
    samples, summary = data["samples"], data["summary"]
    prefills = [s for s in samples if s["kind"] == "prefill"]
    assert len(prefills) == 2 * 2 * 2 and all(s["first_token_s"] > 0 for s in prefills)
    for history in ("16", "24"):
        first = summary["first_token_s"]
        assert summary["prefill_speed_current_over_baseline"][history] == pytest.approx(
            first["baseline"][history] / first["current"][history], abs=1e-3
        )
    assert data["config"]["current_env"] == ["KAKEYA_DENSE_ATTENTION=flash"]
    samples = [s for s in samples if s["kind"] == "decode"]
    assert len(samples) == 2 * 2 * 2  # revisions x histories x repeats
    assert {(s["revision"], s["history"]) for s in samples} == {
        (rev, h) for rev in ("baseline", "current") for h in (16, 24)
    }
    assert all(len(s["tokens"]) == 4 for s in samples)
    assert summary["tokens_agree"] is True, "HEAD and the working tree decode the same tokens"
    for history in ("16", "24"):
        rates = summary["decode_tokens_per_s"]
        assert summary["current_over_baseline"][history] == pytest.approx(
            rates["current"][history] / rates["baseline"][history], abs=1e-3
        )
    again = tmp_path / "again"
    again.mkdir()
    assert data["config"]["baseline_commit"] == bench.export_revision("HEAD", again)
    assert (again / "inference_engine" / "engine.py").exists(), "the baseline daemon's packages are exported"


def test_sessions_at_once_decode_the_same_tokens_and_report_their_aggregate_rate(tmp_path):
    argv = ["--baseline", "HEAD", "--histories", "16", "--new-tokens", "5", "--repeats", "1", "--sessions", "3"]
    assert _bench().main([*argv, "--out", str(tmp_path)]) == 0

    (json_path,) = tmp_path.glob("bench_daemon_revisions_*.json")
    data = json.loads(json_path.read_text())
    decodes = [s for s in data["samples"] if s["kind"] == "decode"]
    assert len(decodes) == 2 and all(s["forks_agree"] is True and len(s["tokens"]) == 5 for s in decodes)
    # three forks' 15 tokens over a wall no shorter than the slowest fork's first token
    assert all(0 < s["decode_tokens_per_s"] <= 15 / s["ttft_s"] for s in decodes)
    assert data["summary"]["tokens_agree"] is True


def test_an_unknown_revision_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown revision"):
        _bench().main(["--baseline", "no-such-revision", "--out", str(tmp_path)])


def test_a_current_env_without_a_name_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        _bench().main(["--baseline", "HEAD", "--current-env", "=1", "--out", str(tmp_path)])
