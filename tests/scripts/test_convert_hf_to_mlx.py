"""scripts/convert_hf_to_mlx.py: Hugging Face checkpoints become mlx-lm model directories of the same model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from inference_engine.config import BUNDLED_MODEL_DIR
from tests.support.backends import convert_script
from tests.support.children import run_child

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_child([sys.executable, "scripts/convert_hf_to_mlx.py", *args], cwd=ROOT)


def test_the_cli_converts_gemma3_with_the_keys_mlx_lm_reads(checkpoints, tmp_path):
    out = tmp_path / "gemma3-mlx"
    result = _run(str(checkpoints["gemma3"]), str(out), "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())
    # layer_types [sliding, full, sliding]: mlx-lm's gemma3_text places full attention every 2nd layer.
    assert config["sliding_window_pattern"] == 2
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
    assert (out / "model.safetensors").is_file()


def test_an_existing_output_directory_is_replaced_only_with_force(checkpoints, tmp_path, capsys):
    main = convert_script().main
    out = tmp_path / "llama-mlx"
    assert main([str(checkpoints["llama"]), str(out)]) == 0
    assert main([str(checkpoints["llama"]), str(out)]) == 1
    assert "exists; pass --force" in capsys.readouterr().err
    assert main([str(checkpoints["llama"]), str(out), "--force"]) == 0


def test_tokenizer_files_are_copied_and_mlx_lm_loads_the_result_with_its_own_loader(tmp_path):
    from mlx_lm.utils import load

    out = convert_script().convert(BUNDLED_MODEL_DIR, tmp_path / "kakeya-tiny-mlx")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (BUNDLED_MODEL_DIR / name).read_bytes()
    model, tokenizer = load(str(out))
    assert tokenizer.decode(tokenizer.encode("hello")) == "hello"
    assert len(model.layers) == json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())["num_hidden_layers"]


def test_layer_types_without_a_period_are_refused():
    script = convert_script()
    config = {"model_type": "gemma3_text", "layer_types": ["sliding_attention", "full_attention", "full_attention"]}
    with pytest.raises(script.ConversionError, match="no period"):
        script.mlx_config_keys(config)


def test_nested_rope_parameters_become_the_flat_keys_mlx_lm_reads():
    keys = convert_script().mlx_config_keys(
        {"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}
    )
    assert keys == {
        "rope_theta": 5e5,
        "rope_scaling": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0},
    }
    assert convert_script().mlx_config_keys({"rope_theta": 1.0, "rope_parameters": {"rope_theta": 2.0}}) == {}


def test_a_directory_without_config_is_refused(tmp_path, capsys):
    assert convert_script().main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert "config.json is missing" in capsys.readouterr().err
