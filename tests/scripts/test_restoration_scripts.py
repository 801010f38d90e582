"""Smoke runs of the restoration scripts on the bundled model: `train_f_theta.py` fits and writes a loadable plan,
`plan_restore.py` measures every layer and source and proposes a plan, `eval_niah.py` runs `dlm_restore` arms."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kv_cache_proposer.restoration import RestorationPlan
from tests.support.children import run_child

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    result = run_child([sys.executable, *args], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_train_f_theta_fits_every_projected_layer_and_resumes_from_its_rows(tmp_path):
    out, rows = tmp_path / "plan" / "restore_plan.json", tmp_path / "rows.npz"
    common = ["--texts", "2", "--length", "96", "--out", str(out), "--rows-cache", str(rows)]
    _run(
        "scripts/train_f_theta.py",
        "--plan",
        "tokens,projected<-3,projected<-3,kept",
        *common,
        "--results-dir",
        str(tmp_path),
    )
    plan = RestorationPlan.load(out)
    assert plan.describe() == "L0:tokens, L1:projected<-L3, L2:projected<-L3, L3:kept"
    assert all(plan.layers[i].projection is not None for i in (1, 2))
    (log,) = tmp_path.glob("train_f_theta_*.json")
    summary = json.loads(log.read_text())["summary"]
    assert set(summary["fit_relative_error"]) == {"L3->L1", "L3->L2"} and summary["rows"] == 2 * 96
    assert log.with_suffix(".png").is_file()
    assert all(plan.layers[i].projection.rotary is None for i in (1, 2))  # by default, keys as stored
    again = _run(
        "scripts/train_f_theta.py",
        *("--plan", str(out), *common, "--ridge", "0.1", "--key-frame", "unrotated", "--results-dir", str(tmp_path)),
    )
    assert "read K/V rows from" in again.stderr
    # In the keys' unrotated frame (the bundled model has rotary position embeddings), both sides turned.
    turned = [RestorationPlan.load(out).layers[i].projection for i in (1, 2)]
    assert all(m is not None and m.rotary is not None and m.reads_keys for m in turned)


def test_plan_restore_measures_each_layer_and_writes_a_plan_within_the_budget(tmp_path):
    out = tmp_path / "restore_plan.json"
    _run(
        "scripts/plan_restore.py",
        *("--lengths", "160", "--samples", "1", "--texts", "1", "--train-texts", "1", "--train-length", "96"),
        *("--window", "48", "--budget", "1.0", "--recall-tolerance", "1.0", "--max-kl", "100"),
        *("--out", str(out), "--results-dir", str(tmp_path)),
    )
    (log,) = tmp_path.glob("plan_restore_*.json")
    payload = json.loads(log.read_text())
    sensitivity = payload["samples"]["sensitivity"]
    # The first layer's K/V depend on the token alone: it is rebuilt from tokens, never measured.
    assert payload["summary"]["token_only_layers"] == [0]
    assert len(sensitivity) == 3 * 3  # every other layer from each of the 3 other layers
    assert payload["summary"]["proposal"] is not None
    # Everything is tolerated here, so the cheapest plan keeps one layer and projects the others from it.
    plan = RestorationPlan.load(out)
    assert len(plan.kept_layers) == 1 and plan.layers[0].kind == "tokens"
    assert log.with_suffix(".png").is_file()


def test_train_f_theta_fits_a_layer_from_the_drafter_context(tmp_path):
    out = tmp_path / "drafter" / "restore_plan.json"
    _run(
        "scripts/train_f_theta.py",
        *("--plan", "tokens,projected<-drafter,projected<-3,kept", "--texts", "2", "--length", "96"),
        *("--key-frame", "unrotated", "--out", str(out), "--results-dir", str(tmp_path)),
    )
    plan = RestorationPlan.load(out)
    assert plan.describe() == "L0:tokens, L1:projected<-drafter, L2:projected<-L3, L3:kept"
    assert plan.drafter is not None and plan.feature_layers == (0, 1, 2, 3)  # the bundled drafter's target layers
    projection = plan.layers[1].projection
    assert projection is not None and projection.weight.shape == (192, 2 * 64)  # context row -> L1's K and V
    assert projection.rotary is not None and not projection.reads_keys  # keys written unrotated, then turned
    (log,) = tmp_path.glob("train_f_theta_*.json")
    assert set(json.loads(log.read_text())["summary"]["fit_relative_error"]) == {"drafter->L1", "L3->L2"}


def test_plan_restore_measures_the_drafter_context_source_per_layer(tmp_path):
    result = run_child(
        [
            sys.executable,
            "scripts/plan_restore.py",
            *("--lengths", "160", "--samples", "1", "--texts", "1", "--train-texts", "1", "--train-length", "96"),
            *("--window", "48", "--sources", "drafter", "--dry-run", "--results-dir", str(tmp_path)),
        ],
        cwd=ROOT,
    )
    assert result.returncode in (0, 1), result.stderr[-3000:]  # 1: no plan within the budget, still logged
    (log,) = tmp_path.glob("plan_restore_*.json")
    sensitivity = json.loads(log.read_text())["samples"]["sensitivity"]
    assert [(row["layer"], row["source"]) for row in sensitivity] == [(i, "projected<-drafter") for i in (1, 2, 3)]
    # The context row (192 values) costs more than one layer's K/V (128 values) of the 4 layers.
    assert all(row["state_fraction"] == 1 + 192 / 512 - 0.25 for row in sensitivity)


def test_eval_niah_runs_dlm_restore_arms_with_their_own_plans(tmp_path):
    plan = RestorationPlan.uniform(4, "kept").save(tmp_path / "kept.json")
    arms = ["full", "dlm_restore:recompute", f"dlm_restore:{plan}@kakeya_e8", "dlm_restore:model+kakeya_d4"]
    _run(
        "scripts/eval_niah.py",
        *("--lengths", "128", "--depths", "2", "--samples", "2", "--window", "48", "--max-tokens", "4"),
        *("--kv-strategies", ",".join(arms)),
        *("--results-dir", str(tmp_path)),
    )
    (path,) = tmp_path.glob("eval_niah_*.json")
    summary = json.loads(path.read_text())["summary"]
    assert set(summary["recall"]) == set(arms)
    cost = {arm: summary["cost"][arm]["128"] for arm in arms}
    assert cost["full"]["restoration_state_bytes_per_evicted_token"] == 0
    assert cost["dlm_restore:recompute"]["peak_bytes"] > cost["dlm_restore:recompute"]["sustained_bytes"]
    # `recompute` keeps the token ids only: 4 bytes per committed position, no K/V of evicted positions.
    assert cost["dlm_restore:recompute"]["restoration_state_bytes_per_evicted_token"] == 0
    assert cost["dlm_restore:recompute"]["history_token_bytes_per_token"] == 4
    # The kept layers are packed by the session's compressor: below their dense fp32 size (4 layers x K,V x 64 x 4).
    assert 0 < cost[arms[2]]["restoration_state_bytes_per_evicted_token"] < 4 * 2 * 64 * 4
    # The bundled plan's one kept layer through the plan's D4 compressor: below its dense 512 fp32 bytes.
    assert 0 < cost[arms[3]]["restoration_state_bytes_per_evicted_token"] < 2 * 64 * 4 / 3
    assert all(c["tokens_per_s"] > 0 for c in cost.values())


def test_bench_restore_rebuild_measures_both_modes_against_full(tmp_path):
    plan = RestorationPlan.uniform(4, "kept").save(tmp_path / "kept.json")
    _run(
        "scripts/bench_restore_rebuild.py",
        *("--plans", f"recompute,{plan}", "--prompt", "200", "--new-tokens", "4", "--window", "48"),
        *("--results-dir", str(tmp_path)),
    )
    (path,) = tmp_path.glob("bench_restore_rebuild_*.json")
    summary = json.loads(path.read_text())["summary"]
    assert set(summary["runs"]) == {"full", "recompute/generation", "recompute/step", "kept/generation", "kept/step"}
    assert summary["modes_agree"] and all(summary["matches_full"].values())
    runs = summary["runs"]
    assert runs["recompute/generation"]["peak_bytes"] > runs["recompute/generation"]["sustained_bytes"]
    assert runs["kept/step"]["sustained_bytes"] > runs["recompute/step"]["sustained_bytes"]  # kept K/V vs token ids
    assert path.with_suffix(".png").is_file()


def test_bench_restore_rebuild_runs_a_plan_with_compressed_kept_layers_in_one_mode(tmp_path):
    _run(
        "scripts/bench_restore_rebuild.py",
        *("--plans", "model,model+kakeya_d4", "--modes", "generation", "--prompt", "200", "--new-tokens", "4"),
        *("--window", "48", "--results-dir", str(tmp_path)),
    )
    (path,) = tmp_path.glob("bench_restore_rebuild_*.json")
    payload = json.loads(path.read_text())
    assert set(payload["summary"]["runs"]) == {"full", "model/generation", "model+kakeya_d4/generation"}
    state = {s["run"]: s["restoration_state_bytes"] / s["evicted_tokens"] for s in payload["samples"][1:]}
    assert state["model/generation"] == 2 * 64 * 4  # the bundled plan keeps layer 3: K and V of 64 fp32 values
    assert 0 < state["model+kakeya_d4/generation"] < state["model/generation"] / 3


def test_plan_restore_measures_named_plans_without_a_sweep_and_writes_none(tmp_path):
    _run(
        "scripts/plan_restore.py",
        *("--lengths", "160", "--samples", "1", "--texts", "1", "--train-texts", "1", "--train-length", "96"),
        *("--window", "48", "--plans", "tokens,projected<-drafter,projected<-3,kept;kept"),
        *("--out", str(tmp_path / "restore_plan.json"), "--results-dir", str(tmp_path)),
    )
    (log,) = tmp_path.glob("plan_restore_*.json")
    payload = json.loads(log.read_text())
    assert payload["samples"]["sensitivity"] == []
    first, exact = payload["samples"]["combined"]
    assert first["plan"] == "L0:tokens, L1:projected<-drafter, L2:projected<-L3, L3:kept"
    assert set(first["fit_relative_error"]) == {"drafter->L1", "L3->L2"}
    assert exact["kl"] < 1e-6 and exact["recall"] == payload["summary"]["full_recall"]  # keeping every layer is exact
    assert not (tmp_path / "restore_plan.json").exists() and log.with_suffix(".png").is_file()


def test_train_f_theta_distils_the_maps_on_attention_and_logs_the_held_out_error(tmp_path):
    out = tmp_path / "distilled" / "restore_plan.json"
    _run(
        "scripts/train_f_theta.py",
        *("--plan", "tokens,projected<-drafter,projected<-3,kept", "--texts", "3", "--length", "96"),
        *("--distill-steps", "5", "--sink", "2", "--window", "9", "--out", str(out), "--results-dir", str(tmp_path)),
    )
    plan = RestorationPlan.load(out)
    assert "attention-output distillation" in plan.notes["f_theta"]
    (log,) = tmp_path.glob("train_f_theta_*.json")
    attention = json.loads(log.read_text())["summary"]["attention_output_error"]
    assert set(attention) == {"drafter->L1", "L3->L2"}
    assert all(set(pair) == {"least_squares", "distilled"} for pair in attention.values())
    refused = run_child(
        [sys.executable, "scripts/train_f_theta.py", "--plan", "kept", "--texts", "1", "--distill-steps", "5"], cwd=ROOT
    )
    assert refused.returncode == 2 and "--texts >= 2" in refused.stderr
