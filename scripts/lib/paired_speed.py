"""Decode speed of several daemon sessions compared in short paired rounds, for benchmarks on a noisy machine."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_generation(session: Any, tokens: int, pid: int) -> dict[str, float | None]:
    """Generate `tokens` tokens: tokens/s and daemon CPU seconds per token from the first token on (the first
    token of a generation resumes a parked session, which its time to first token measures apart)."""
    stream = session.generate(tokens)
    count, cpu_before = 0, None
    for _ in stream:
        count += 1
        if count == 1:
            cpu_before = cpu_seconds(pid)
    cpu_after = cpu_seconds(pid)
    assert stream.stats is not None
    decode_s = stream.stats.total_duration_s - stream.stats.time_to_first_token_s
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return {
        "tokens_per_s": (count - 1) / decode_s,
        "cpu_s_per_token": cpu / (count - 1) if cpu is not None else None,
        "ttft_s": stream.stats.time_to_first_token_s,
    }


def paired_rounds(
    sessions: Mapping[str, Any], baseline: str, *, rounds: int, tokens: int, pid: int
) -> dict[str, dict[str, Any]]:
    """`rounds` rounds in which every session in turn generates `tokens` tokens (the order reversed every other
    round), so each session's round sits next to the baseline's in time. Per session: its rounds, median tokens/s
    and CPU seconds per token, the per-round speed ratios to `baseline` and their median (which cancels most of a
    shared machine's drift)."""
    timed: dict[str, list[dict[str, float | None]]] = {label: [] for label in sessions}
    for index in tqdm(range(rounds), desc="decode speed", unit="round", file=sys.stderr):
        order = list(sessions.items()) if index % 2 == 0 else list(sessions.items())[::-1]
        for label, session in order:
            timed[label].append(timed_generation(session, tokens, pid))
    base = np.array([r["tokens_per_s"] for r in timed[baseline]], dtype=float)
    out: dict[str, dict[str, Any]] = {}
    for label, rows in timed.items():
        cpu_rows = [r["cpu_s_per_token"] for r in rows if r["cpu_s_per_token"] is not None]
        speeds = np.array([r["tokens_per_s"] for r in rows], dtype=float)
        ratios = (speeds / base).tolist()
        out[label] = {
            "rounds": rows,
            "tokens_per_s": float(np.median(speeds)),
            "cpu_s_per_token": float(np.median(cpu_rows)) if cpu_rows else None,
            "round_ratios_vs_baseline": ratios,
            "speed_vs_baseline": float(np.median(ratios)),
        }
    return out
