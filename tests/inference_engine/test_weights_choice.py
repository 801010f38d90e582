"""`--weights auto` holds a model distributed at 4 bits as int4 on a CPU, and float32 otherwise; the load log says
which choice was made and why, and the loaded verifier holds it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference_engine.model_source import BUNDLED_MODEL_DIR, MANIFEST, choose_weights, resolve_model
from tests.support.daemon import Daemon
from tests.support.gguf_files import write_gguf

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)


def _converted(directory: Path, tensor_types: list[str]) -> Path:
    directory.mkdir()
    (directory / MANIFEST).write_text(json.dumps({"tensor_types": tensor_types}))
    return directory


def test_auto_is_int4_for_a_4_bit_gguf_model_on_a_cpu_with_torch(tmp_path):
    four_bit = _converted(tmp_path / "q4", ["F32", "Q4_1", "Q8_0"])
    choice, why = choose_weights("auto", four_bit, backend="torch", on_cpu=True)
    assert choice == "int4" and "Q4_1" in why


@pytest.mark.parametrize(
    ("types", "backend", "on_cpu"),
    [
        (["F32", "Q8_0"], "torch", True),  # 8-bit weights would lose precision at int4
        (["F32", "Q4_0"], "mlx", True),
        (["F32", "Q4_0"], "torch", False),
    ],
)
def test_auto_is_float32_where_int4_would_lose_precision_or_cannot_run(tmp_path, types, backend, on_cpu):
    assert choose_weights("auto", _converted(tmp_path / "m", types), backend=backend, on_cpu=on_cpu)[0] == "float32"


def test_auto_is_float32_for_a_model_directory_and_an_explicit_choice_is_kept():
    assert choose_weights("auto", BUNDLED_MODEL_DIR, backend="torch", on_cpu=True)[0] == "float32"
    assert choose_weights("int8", BUNDLED_MODEL_DIR, backend="torch", on_cpu=True) == ("int8", "asked for")


def test_a_conversion_records_the_tensor_types_of_its_gguf_file(checkpoints, tmp_path):
    gguf_file = write_gguf(checkpoints["llama"], tmp_path / "llama-q4_0.gguf", "Q4_0")
    directory = resolve_model(str(gguf_file), tmp_path / "cache").directory
    assert "Q4_0" in json.loads((directory / MANIFEST).read_text())["tensor_types"]


@pytest.mark.parametrize(
    ("flag", "kv_flag", "expected", "kv_bfloat16"),
    [("auto", "auto", "int4", True), ("auto", "model", "int4", False), ("float32", "auto", "float32", False)],
)
def test_the_load_log_names_the_weights_the_daemon_holds(checkpoints, tmp_path, flag, kv_flag, expected, kv_bfloat16):
    """...and the K/V precision: auto holds a session's K/V at bfloat16 under int4 weights."""
    gguf_file = write_gguf(checkpoints["llama"], tmp_path / "llama-q4_0.gguf", "Q4_0")
    daemon = Daemon(
        "serve", "--model", str(gguf_file), "--model-cache-dir", str(tmp_path / "cache"), "--weights", flag,
        "--kv-dtype", kv_flag, "--port", "0", "--metrics-port", "-1", "--log-format", "json", "--device", "cpu",
    )  # fmt: skip
    try:
        daemon.wait_listening()
    finally:
        daemon.kill()
    records = [json.loads(line) for line in daemon.lines if line.startswith("{")]
    chosen = next(r for r in records if r["msg"].startswith("weights: "))
    assert chosen["weights"] == expected
    assert chosen["msg"].startswith(
        f"weights: {expected} (auto: " if flag == "auto" else "weights: float32 (asked for)"
    )
    loaded = next(r for r in records if r["msg"] == "model loaded")
    assert (f"weights: {expected}" in loaded["verifier"]) == (expected != "float32")
    assert ("K/V: bfloat16" in loaded["verifier"]) == kv_bfloat16
