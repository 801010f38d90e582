"""The common results format: `results/<name>_<stamp>.json` (config, environment, samples, summary) + a PNG."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "results"


def environment(**extra: Any) -> dict[str, Any]:
    """Where and on what a measurement was taken, plus `extra` fields."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu": _cpu_name(),
    }
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["git_commit"] = None
    # the daemon's settings by environment (KAKEYA_DENSE_ATTENTION, ...): the daemons a script starts inherit them
    info["kakeya_settings"] = {name: value for name, value in sorted(os.environ.items()) if name.startswith("KAKEYA_")}
    if "torch" in sys.modules:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()  # the vector ISA its kernels use
        if torch.cuda.is_available():
            info["cuda_device"] = torch.cuda.get_device_name()
    return {**info, **extra}


def _cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def new_stamp() -> str:
    """The UTC time as results files are stamped."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def write_results(
    name: str,
    *,
    config: dict[str, Any],
    samples: Any,
    summary: dict[str, Any],
    plot: Callable[[Path], None] | None = None,
    out_dir: Path = RESULTS_DIR,
    environment_extra: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    stamp: str | None = None,
) -> Path:
    """Write the JSON (and, given `plot`, a PNG of the same stem drawn by `plot(png_path)`); returns the JSON path.

    `extra` adds top-level fields (e.g. per-bucket aggregates) next to the common ones. `stamp` (default: now, as
    `new_stamp()` makes it) names the file; a script that writes its results as it goes passes the same one each time.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = stamp or new_stamp()
    path = out_dir / f"{name}_{stamp}.json"
    payload = {
        "name": name,
        "stamp": stamp,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in config.items()},
        "environment": environment(**(environment_extra or {})),
        "summary": summary,
        **(extra or {}),
        "samples": samples,
    }
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    if plot is not None:
        plot(path.with_suffix(".png"))
    return path
