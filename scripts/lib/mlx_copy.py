"""The model as an mlx-lm directory, for the benches that run mlx-lm itself: converted by
scripts/convert_hf_to_mlx.py (float32, the weights as the daemon reads them)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CONVERT = Path(__file__).resolve().parents[1] / "convert_hf_to_mlx.py"


def convert_to_mlx(model_dir: Path, target: Path, *, quiet: bool = False) -> Path:
    """Write the float32 mlx-lm copy of `model_dir` to `target` (its output hidden when `quiet`); returns `target`."""
    command = [sys.executable, str(CONVERT), str(model_dir), str(target), "--dtype", "float32"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL if quiet else None)
    return target


@contextmanager
def mlx_copy(model_dir: Path) -> Iterator[Path]:
    """The float32 mlx-lm copy of `model_dir`, in a temporary directory removed on exit."""
    with tempfile.TemporaryDirectory(prefix="kakeya-mlx-copy-") as tmp:
        yield convert_to_mlx(model_dir, Path(tmp) / "mlx")
