"""A C compiler that fails, for the tests of what the compiled kernels do when they cannot be built."""

from __future__ import annotations

from pathlib import Path

import pytest


def use_broken_compiler(monkeypatch: pytest.MonkeyPatch, directory: Path, message: str) -> None:
    """Point `CC` at a compiler in `directory` that reports a version and fails every build with `message`."""
    broken = directory / "cc"
    broken.write_text(
        f"#!/bin/sh\n[ \"$1\" = --version ] && echo broken-cc 1.0 && exit 0\necho '{message}' >&2\nexit 1\n"
    )
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
