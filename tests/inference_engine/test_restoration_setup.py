"""A restoration plan the served model directory ships is used as shipped or refused at start: never ignored.

Built through the server's own start-up path (`load_runtime`, and the `kakeya-runtime serve` console script)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from inference_engine.config import ConfigError, ServerConfig
from inference_engine.server import load_runtime
from kv_cache_proposer.restoration import PLAN_FILE, RestorationPlan
from tests.support.checkpoints import save_checkpoint
from tests.support.daemon import CONSOLE_SCRIPT


@pytest.fixture(scope="module")
def model_with_foreign_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 3-layer checkpoint whose directory ships a plan made for a 5-layer model."""
    model_dir = save_checkpoint("qwen3", tmp_path_factory.mktemp("foreign-plan") / "model")
    RestorationPlan.uniform(5, "kept").save(model_dir / PLAN_FILE)
    return model_dir


def _config(model_dir: Path, **overrides: object) -> ServerConfig:
    return ServerConfig(model=str(model_dir), port=0, metrics_port=0, device="cpu", dtype="float32", **overrides)


@pytest.mark.parametrize("kv_strategy", ["full", "dlm_restore"])
def test_a_shipped_plan_that_does_not_fit_the_model_stops_the_start_whatever_the_default_strategy(
    model_with_foreign_plan: Path, kv_strategy: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        load_runtime(_config(model_with_foreign_plan, kv_strategy=kv_strategy))
    message = str(raised.value)
    assert str(model_with_foreign_plan / PLAN_FILE) in message
    assert "the restoration plan has 5 layers, the model 3" in message
    assert "--restore-plan recompute" in message and "scripts/plan_restore.py" in message


def test_restore_plan_recompute_serves_a_model_whose_shipped_plan_does_not_fit(model_with_foreign_plan: Path) -> None:
    runtime = load_runtime(_config(model_with_foreign_plan, restore_plan="recompute"))
    assert runtime.restoration.plan is None  # every evicted layer recomputed: the exact reference


def test_a_named_plan_that_cannot_be_read_stops_the_start_naming_the_file(tmp_path: Path) -> None:
    model_dir = save_checkpoint("qwen3", tmp_path / "model")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match=r"--restore-plan .*broken\.json.*cannot read restoration plan"):
        load_runtime(_config(model_dir, restore_plan=str(broken)))


def test_the_console_script_refuses_the_foreign_plan_in_words_with_exit_status_2(
    model_with_foreign_plan: Path,
) -> None:
    result = subprocess.run(
        [str(CONSOLE_SCRIPT), "serve", "--model", str(model_with_foreign_plan), "--port", "0", "--metrics-port", "-1"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "cannot serve this model: restore_plan: cannot use the model directory's restoration plan" in result.stderr
    assert "--restore-plan recompute" in result.stderr and "listening" not in result.stderr
