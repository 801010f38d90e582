"""The common results format: `results/<name>_<stamp>.json` (config, environment, samples, summary) + a PNG."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "results"


def environment() -> dict[str, Any]:
    """Where a measurement was taken."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


def write_results(
    name: str,
    *,
    config: dict[str, Any],
    samples: Any,
    summary: dict[str, Any],
    plot: Callable[[Path], None] | None = None,
    out_dir: Path = RESULTS_DIR,
) -> Path:
    """Write the JSON (and, given `plot`, a PNG of the same stem drawn by `plot(png_path)`); returns the JSON path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"{name}_{stamp}.json"
    payload = {
        "name": name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": config,
        "environment": environment(),
        "summary": summary,
        "samples": samples,
    }
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    if plot is not None:
        plot(path.with_suffix(".png"))
    return path
