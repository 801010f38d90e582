"""The results format's environment block: where a measurement was taken, and the daemon settings given by
environment variables, which the daemons a script starts inherit."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from lib.results import environment  # noqa: E402


def test_the_environment_names_the_daemon_settings_in_force_and_only_those(monkeypatch):
    monkeypatch.setenv("KAKEYA_DENSE_ATTENTION", "compiled")
    monkeypatch.setenv("UNRELATED_SETTING", "1")
    recorded = environment()
    assert recorded["kakeya_settings"]["KAKEYA_DENSE_ATTENTION"] == "compiled"
    assert all(name.startswith("KAKEYA_") for name in recorded["kakeya_settings"])
    monkeypatch.delenv("KAKEYA_DENSE_ATTENTION")
    assert "KAKEYA_DENSE_ATTENTION" not in environment()["kakeya_settings"]
