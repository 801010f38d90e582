"""The SDK stands alone: it imports no server package, and its wheel installs and works without the repository."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SDK = ROOT / "sdks" / "python"
SERVER_PACKAGES = {"inference_engine", "kv_cache_proposer", "tests", "torch"}


def test_no_sdk_source_or_example_imports_a_server_package():
    for path in [*SDK.rglob("*.py")]:
        if "_generated" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            assert not {name.split(".")[0] for name in names} & SERVER_PACKAGES, f"{path}: {names}"


def test_importing_the_sdk_loads_neither_server_packages_nor_transformers():
    code = (
        "import sys, kakeya, kakeya.aio, kakeya.tokenization\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'inference_engine', 'kv_cache_proposer', 'torch', "
        "'transformers'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=SDK).stdout
    assert out.strip() == "[]"


def test_the_built_wheel_carries_its_stubs_and_types_and_runs_from_anywhere(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(SDK),
        ],
        check=True,
        capture_output=True,
    )
    [wheel] = tmp_path.glob("kakeya-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
        archive.extractall(tmp_path / "site")
    assert {"kakeya/py.typed", "kakeya/_generated/runtime_pb2.py", "kakeya/_generated/runtime_pb2.pyi"} <= names
    requires = sorted(line for line in metadata.splitlines() if line.startswith("Requires-Dist:"))
    assert [r for r in requires if "extra ==" not in r] == [
        "Requires-Dist: grpcio>=1.85.1",
        "Requires-Dist: protobuf>=7.35.1",
    ]
    assert any("transformers" in r and 'extra == "tokenization"' in r for r in requires)
    code = "import kakeya; print(kakeya.__file__); print(kakeya.Client('127.0.0.1:1').address)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path, env=env
    )
    location, address = out.stdout.split()
    assert Path(location).is_relative_to(tmp_path / "site") and address == "127.0.0.1:1"
