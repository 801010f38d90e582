"""Every script says how it is run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module_doc(path: Path) -> str:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module.__doc__ or ""


def test_every_script_documents_its_usage():
    # scripts/lib holds the modules the scripts import, not scripts of their own.
    scripts = sorted(p for p in (ROOT / "scripts").rglob("*.py") if "lib" not in p.relative_to(ROOT / "scripts").parts)
    assert any(script.parent != ROOT / "scripts" for script in scripts), "scripts in subfolders are checked too"
    for script in scripts:
        assert "Usage" in _module_doc(script), script.relative_to(ROOT)
