"""A revision of this repository's packages, exported from git beside the working tree: what the revision benches
compare the working tree with."""

from __future__ import annotations

import subprocess
import tarfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def export_revision(revision: str, target: Path, packages: Sequence[str], *, tool: str) -> str:
    """`packages` at `revision`, unpacked under `target`; returns the full commit id. An unknown revision ends the
    program with a message naming `tool`."""
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{revision}^{{commit}}"], cwd=ROOT, capture_output=True, text=True
    )
    if commit.returncode != 0:
        raise SystemExit(f"{tool}: unknown revision {revision!r}")
    archive = target / "packages.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "archive", commit.stdout.strip(), *packages], cwd=ROOT, stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    return commit.stdout.strip()
