"""scripts/bench_decode.py: a smoke run measures every arm on both backends and writes ratios to the bare loops,
and on torch every arm once per weights choice."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    path = ROOT / "scripts" / "bench_decode.py"
    spec = importlib.util.spec_from_file_location("bench_decode", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_a_smoke_run_measures_every_arm_and_writes_the_ratios(tmp_path):
    bench = _bench()
    assert bench.main(["--smoke", "--mlx-daemon-blas", "auto", "--out", str(tmp_path)]) == 0

    (json_path,) = tmp_path.glob("bench_decode_*.json")
    assert json_path.with_suffix(".png").stat().st_size > 0
    data = json.loads(json_path.read_text())
    samples, summary = data["samples"], data["summary"]
    assert data["config"]["model_name"] == "kakeya-tiny", "the results name the model, not only its directory"
    arms = {(s["backend"], s["arm"]) for s in samples["decode"]}
    assert arms == {
        ("torch", "daemon:none"),
        ("torch", "engine"),
        ("torch", "bare_loop"),
        ("torch", "generate"),
        ("mlx", "daemon:none"),
        ("mlx", "daemon:none:blas=auto"),
        ("mlx", "engine"),
        ("mlx", "engine:burst1"),
        ("mlx", "mlx_lm"),
        ("mlx", "mlx_lm:input_major"),
    }
    assert len(samples["decode"]) == 2 * 2 * len(arms), "two repeats of every arm at each of two histories"
    for sample in samples["decode"]:
        assert len(sample["tokens"]) == 6 and sample["decode_tokens_per_s"] > 0
    for backend, bare in (("torch", "bare_loop"), ("mlx", "mlx_lm")):
        part = summary[backend]
        assert part["tokens_agree"] is True, "the daemon, the engine and the bare loop decode the same greedy tokens"
        assert part["repeats_agree"] is True, "every repeat decodes from the same prefilled state"
        assert part["decode_ratio_to_bare"][bare] == {"48": 1.0, "96": 1.0}
        ratio = part["decode_tokens_per_s"]["engine"]["96"] / part["decode_tokens_per_s"][bare]["96"]
        assert abs(part["decode_ratio_to_bare"]["engine"]["96"] - ratio) < 0.01
        blas_arms = {"daemon:none:blas=auto"} if backend == "mlx" else set()
        assert set(part["prefill_tokens_per_s"]) == {"daemon:none", "engine", "engine:16", "one_forward"} | blas_arms
        assert set(part["per_token_time_longest_over_shortest"]) >= {"engine", bare}


def test_each_weights_choice_runs_every_torch_arm_and_is_compared_to_float32(tmp_path):
    bench = _bench()
    assert bench.main(["--smoke", "--backends", "torch", "--weights", "float32,int4", "--out", str(tmp_path)]) == 0

    (json_path,) = tmp_path.glob("bench_decode_*.json")
    data = json.loads(json_path.read_text())
    samples, part = data["samples"], data["summary"]["torch"]
    plain = {"daemon:none", "engine", "bare_loop", "generate"}
    arms = {s["arm"] for s in samples["decode"]}
    assert arms == plain | {f"{arm}@int4" for arm in plain}, "float32 arms keep their names, int4 arms carry @int4"
    assert {s["weights"] for s in samples["decode"] if s["arm"].endswith("@int4")} == {"int4"}
    assert len(samples["decode"]) == 2 * 2 * len(arms), "two repeats of every arm at each of two histories"

    assert part["tokens_agree"] is True and part["repeats_agree"] is True
    assert part["decode_ratio_to_bare"]["bare_loop@int4"] == {"48": 1.0, "96": 1.0}, "int4 over int4's bare loop"
    rates = part["decode_tokens_per_s"]
    ratio = rates["daemon:none@int4"]["96"] / rates["bare_loop@int4"]["96"]
    assert part["decode_ratio_to_bare"]["daemon:none@int4"]["96"] == pytest.approx(ratio, rel=0.02)  # rates rounded

    int4, float32 = part["weights"]["int4"], part["weights"]["float32"]
    assert int4["tokens_agree"] is True, "the daemon, the engine and the bare loop at int4 decode the same tokens"
    assert float32["daemon_decode_ratio_to_float32"] == {"48": 1.0, "96": 1.0}
    ratio = rates["daemon:none@int4"]["96"] / rates["daemon:none"]["96"]
    assert int4["daemon_decode_ratio_to_float32"]["96"] == pytest.approx(ratio, rel=0.02)
    prefill = part["prefill_tokens_per_s"]
    assert set(prefill) == {
        f"{arm}{w}" for arm in ("daemon:none", "engine", "engine:16", "one_forward") for w in ("", "@int4")
    }
    ratio = prefill["daemon:none@int4"] / prefill["daemon:none"]
    assert int4["daemon_prefill_ratio_to_float32"] == pytest.approx(ratio, rel=0.02)
    assert part["prefill_ratio_to_one_forward"]["one_forward@int4"] == 1.0
    assert all(0 <= n <= 6 for n in int4["tokens_before_diverging_from_float32"].values()), "recorded, not checked"


def test_compiled_arms_run_beside_their_scripted_selves_and_record_their_compile_time(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the daemons inherit it
    bench = _bench()
    assert bench.main(["--smoke", "--backends", "torch", "--compile", "--out", str(tmp_path)]) == 0

    (json_path,) = tmp_path.glob("bench_decode_*.json")
    data = json.loads(json_path.read_text())
    samples, part = data["samples"], data["summary"]["torch"]
    plain = {"daemon:none", "engine"}
    arms = {s["arm"] for s in samples["decode"]}
    assert arms == plain | {f"{arm}+compiled" for arm in plain} | {"bare_loop", "generate"}
    assert {s["arm"] for s in samples["compile"]} == {"engine+compiled", "daemon:none+compiled"}
    assert part["tokens_agree"] is True and part["repeats_agree"] is True

    rates = part["decode_tokens_per_s"]
    for arm, compiled in part["compiled"].items():
        scripted = arm.removesuffix("+compiled")
        assert compiled["scripted_arm"] == scripted and compiled["compile_s"] > 0
        assert compiled["tokens_equal"] == {"48": True, "96": True}, "float rounding moves no greedy token here"
        ratio = rates[arm]["96"] / rates[scripted]["96"]
        assert compiled["decode_ratio_to_scripted"]["96"] == pytest.approx(ratio, rel=0.02)  # rates rounded
    assert any((tmp_path / "inductor").rglob("*.py")), "the graphs went to the inductor cache named"


def test_the_summary_gives_each_daemon_arm_its_ratio_to_none_and_its_tokens_per_forward():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from lib.decode_summary import summarize

    tokens = list(range(8))

    def decode(arm: str, history: int, rate: float, forwards: int | None) -> dict:
        sample = {"backend": "torch", "arm": arm, "weights": "float32", "history": history, "tokens": tokens}
        return {**sample, "decode_tokens_per_s": rate, **({"forwards": forwards} if forwards else {})}

    samples = {
        "decode": [
            decode(arm, history, rate * (1 if history == 64 else 0.5), forwards)
            for arm, rate, forwards in (
                ("daemon:none", 100.0, 8),
                ("daemon:dflash/cost", 150.0, 2),
                ("engine", 120.0, None),
                ("bare_loop", 80.0, None),
            )
            for history in (64, 128)
        ],
        "prefill": [
            {"backend": "torch", "arm": arm, "weights": "float32", "prefill_s": 1.0}
            for arm in ("daemon:none", "one_forward")
        ],
    }
    part = summarize(samples, argparse.Namespace(backends=["torch"], prefill_tokens=64))["torch"]
    assert part["daemon_ratio_to_none"]["daemon:dflash/cost"] == {"64": 1.5, "128": 1.5}
    assert part["tokens_per_forward"] == {
        "daemon:none": {"64": 1.0, "128": 1.0},
        "daemon:dflash/cost": {"64": 4.0, "128": 4.0},
    }
    assert "engine" not in part["daemon_ratio_to_none"], "daemon arms only"
