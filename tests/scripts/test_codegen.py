import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_codegen():
    spec = importlib.util.spec_from_file_location("codegen", ROOT / "scripts" / "codegen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_current():
    result = subprocess.run([sys.executable, "scripts/codegen.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_fails_when_a_generated_file_was_edited(tmp_path, monkeypatch):
    codegen = _load_codegen()
    target = tmp_path / "pkg" / "generated"
    shutil.copytree(ROOT / "inference_engine" / "generated", target)
    monkeypatch.setattr(codegen, "PYTHON_TARGETS", [target])
    monkeypatch.setattr(sys, "argv", ["codegen.py", "--check"])
    assert codegen.main() == 0
    stub = target / "runtime_pb2_grpc.py"
    stub.write_text(stub.read_text() + "\n# hand edit\n")
    assert codegen.main() == 1


def test_generated_stubs_import_their_sibling_relatively():
    text = (ROOT / "inference_engine" / "generated" / "runtime_pb2_grpc.py").read_text()
    assert "from . import runtime_pb2" in text and "from kakeya.v1" not in text
