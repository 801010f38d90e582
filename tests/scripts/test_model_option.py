"""scripts/lib/model_option.py: every script's --model takes a model name or a model directory as the daemon's does,
loads the directory it stands for and keeps the name it was given; arms that need what a model does not ship are
left out with a note."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from inference_engine.model_source import BUNDLED_MODEL_DIR

ROOT = Path(__file__).resolve().parents[2]
# Every script that takes --model, with the flags it requires besides.
SCRIPTS = {
    "bench_decode.py": [],
    "bench_speculative.py": [],
    "bench_concurrency.py": [],
    "bench_agentic/bench_session_long_run.py": [],
    "eval_niah.py": [],
    "bench_kv_compression.py": [],
    "bench_restore_rebuild.py": [],
    "plan_restore.py": [],
    "bench_load.py": [],
    "bench_mlx_backend.py": [],
    "bench_structured.py": [],
    "bench_threads.py": [],
    "bench_engine_revisions.py": ["--baseline", "HEAD"],
    "train_f_theta.py": ["--plan", "kept"],
}


def _script(name: str) -> ModuleType:
    path = ROOT / "scripts" / name
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def bare_model(tmp_path: Path) -> Path:
    """A model directory (kakeya-tiny's config, all that parsing reads) with no DFlash drafter and no restoration
    plan."""
    directory = tmp_path / "bare-model"
    directory.mkdir()
    shutil.copy(BUNDLED_MODEL_DIR / "config.json", directory / "config.json")
    return directory


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_model_takes_a_model_name_or_a_directory_and_keeps_the_name(script, bare_model):
    parse_args = _script(script).parse_args
    required = SCRIPTS[script]

    by_default = parse_args(required)
    assert (by_default.model, by_default.model_name) == (BUNDLED_MODEL_DIR, "kakeya-tiny")
    named = parse_args([*required, "--model", "kakeya-tiny"])
    assert (named.model, named.model_name) == (BUNDLED_MODEL_DIR, "kakeya-tiny")
    directory = parse_args([*required, "--model", str(bare_model)])
    assert (directory.model, directory.model_name) == (bare_model, str(bare_model))


def test_a_model_that_is_neither_a_name_nor_a_path_is_refused_with_the_names(capsys):
    with pytest.raises(SystemExit) as stopped:
        _script("bench_threads.py").parse_args(["--model", "no-such-model"])
    assert stopped.value.code == 2
    assert "not a model name (smollm2-135m-instruct, kakeya-tiny)" in capsys.readouterr().err


def test_arms_of_what_the_model_does_not_ship_are_left_out_with_a_note(bare_model, capsys):
    decode = _script("bench_decode.py")
    assert decode.parse_args([]).daemon_proposers == ["none", "dflash"], "kakeya-tiny ships a DFlash drafter"
    assert decode.parse_args(["--model", str(bare_model)]).daemon_proposers == ["none"]
    assert "ships no DFlash drafter" in capsys.readouterr().err

    rebuild = _script("bench_restore_rebuild.py")
    assert rebuild.parse_args([]).plans == ["recompute", "model"], "kakeya-tiny ships a restoration plan"
    assert rebuild.parse_args(["--model", str(bare_model)]).plans == ["recompute"]
    assert "ships no restoration plan" in capsys.readouterr().err

    with pytest.raises(SystemExit):
        _script("bench_concurrency.py").parse_args(["--model", str(bare_model), "--proposer", "dflash"])
    assert "ships no DFlash drafter" in capsys.readouterr().err
