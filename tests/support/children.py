"""Child processes of the tests (scripts, examples, `python -c` probes), each bounded within the per-test time cap."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHILD_TIMEOUT_S = 240
"""The longest one child may run: the per-test cap (`timeout = 300` in pyproject.toml) less a margin for the test's
own set-up, so a child that hangs fails its test with the command and the end of its output before the cap cuts the
test off."""


def run_child(
    command: Sequence[str | Path], *, timeout_s: float = CHILD_TIMEOUT_S, **options: Any
) -> subprocess.CompletedProcess[str]:
    """Run `command` to its end, its stdout and stderr captured as text (`options` go to `subprocess.run`: `cwd`,
    `input`, `env`); a child still running after `timeout_s` is killed and fails the test."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, **options)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        shown = " ".join(str(part) for part in command)
        raise AssertionError(f"{shown} still ran after {timeout_s:g} s; its stderr ended:\n{stderr[-3000:]}") from None
