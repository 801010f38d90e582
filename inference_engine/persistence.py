"""Session snapshots for `--state-dir`: what every live session holds, written on graceful shutdown and read
back on the next start.

A snapshot keeps each session's id, label, end-of-sequence ids, KV strategy and full token history. The K/V
itself is not written: a restored session's whole history is pending, and its next generation prefills it, which
by INV-3 continues exactly as the session would have. A snapshot belongs to the model it was written with; a
start with another model refuses it rather than serving histories tokenized for a different vocabulary.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from inference_engine.sessions import Session
from kv_cache_proposer.strategies import strategy_options

SNAPSHOT_NAME = "sessions.json"
FORMAT = 1


class SnapshotError(RuntimeError):
    """The state directory cannot be read or written, or its snapshot does not fit this model."""


@dataclass(frozen=True, slots=True)
class SessionRecord:
    session_id: str
    label: str
    eos_token_ids: list[int]
    kv_strategy: str
    sink: int
    window: int
    idle_seconds: float
    tokens: list[int]


def session_records(sessions: list[Session], now: float) -> list[SessionRecord]:
    """`sessions` as snapshot records, in the order given."""
    records = []
    for session in sessions:
        strategy = session.seq.cache.strategy
        options = strategy_options(strategy)
        records.append(
            SessionRecord(
                session_id=session.session_id,
                label=session.label,
                eos_token_ids=sorted(session.eos_token_ids),
                kv_strategy=strategy.name,
                sink=options.get("sink", 0),
                window=options.get("window", 0),
                idle_seconds=max(0.0, now - session.last_access),
                tokens=list(session.seq.tokens),
            )
        )
    return records


def snapshot_path(directory: Path) -> Path:
    return directory / SNAPSHOT_NAME


def write_snapshot(directory: Path, model: dict[str, Any], records: list[SessionRecord]) -> Path:
    """Write the snapshot atomically (a crash mid-write leaves the previous file, never half of one)."""
    path = snapshot_path(directory)
    body = {"format": FORMAT, "model": model, "sessions": [asdict(r) for r in records]}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(body) + "\n")
        os.replace(partial, path)
    except OSError as exc:
        raise SnapshotError(f"cannot write the session snapshot {path}: {exc}") from exc
    return path


def read_snapshot(directory: Path, model: dict[str, Any]) -> list[SessionRecord]:
    """The sessions of the snapshot in `directory` (none when there is no snapshot), least recently used first."""
    path = snapshot_path(directory)
    if directory.exists() and not directory.is_dir():
        raise SnapshotError(f"the state directory {directory} is not a directory")
    if not path.exists():
        return []
    try:
        body = json.loads(path.read_text())
        if body.get("format") != FORMAT:
            raise SnapshotError(f"{path} has snapshot format {body.get('format')!r}; this server reads {FORMAT}")
        records = [SessionRecord(**entry) for entry in body["sessions"]]
    except SnapshotError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SnapshotError(f"cannot read the session snapshot {path}: {exc}") from exc
    if body.get("model") != model:
        raise SnapshotError(
            f"the session snapshot {path} was written for {body.get('model')}, not {model}: start with that model, "
            "or move the snapshot away to start without its sessions"
        )
    return records


def consume_snapshot(directory: Path) -> None:
    """Remove the snapshot once its sessions are live, so a later crash cannot bring back stale ones."""
    snapshot_path(directory).unlink(missing_ok=True)
