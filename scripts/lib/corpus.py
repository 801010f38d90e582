"""The offline text corpus: the Python standard library's own source, which ships with every interpreter.

Files are taken in sorted order; every `HOLDOUT_EVERY`-th file is held out (never trained on) for evaluation.
GUI and demo packages are left out. Prose (`manual_sections`): the topics of the Python reference manual that ship
with the interpreter (`pydoc_data`), which no training script reads.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
EXCLUDED = {"idlelib", "tkinter", "turtledemo", "site-packages"}
HOLDOUT_EVERY = 20


def stdlib_sources(root: Path = STDLIB) -> list[Path]:
    """Every standard-library `.py` file outside the excluded packages, sorted."""
    return sorted(p for p in root.rglob("*.py") if not EXCLUDED.intersection(p.relative_to(root).parts))


def split_sources(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files)."""
    held = paths[HOLDOUT_EVERY - 1 :: HOLDOUT_EVERY]
    held_set = set(held)
    return [p for p in paths if p not in held_set], held


def manual_sections() -> list[tuple[str, str]]:
    """The reference manual's topics as (name, text), sorted by name."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return [(key, topics[key]) for key in sorted(topics)]


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def fingerprint(paths: list[Path]) -> str:
    """SHA-256 over the files' contents, so a log says exactly which text a model saw."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()
