"""--threads resolves to the measured default and limits the tensor libraries."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from inference_engine.config import ConfigError, ServerConfig
from inference_engine.threads import resolve_threads, usable_cores


def test_zero_threads_resolves_to_one_per_usable_core():
    assert resolve_threads(0, cores=16) == 16
    assert resolve_threads(0) == usable_cores()
    assert resolve_threads(3, cores=1) == 3, "an explicit count is taken as given"


def test_negative_threads_are_refused():
    with pytest.raises(ConfigError, match="threads must be >= 0"):
        ServerConfig(threads=-1)


def test_apply_threads_sets_torch_and_the_blas_environment_in_a_fresh_process():
    code = (
        "from inference_engine.threads import apply_threads\n"
        "apply_threads(1, 'torch')\n"
        "import os, torch\n"
        "print(torch.get_num_threads(), torch.get_num_interop_threads(), os.environ['OPENBLAS_NUM_THREADS'],"
        " os.environ['OMP_WAIT_POLICY'], os.environ['OPENBLAS_THREAD_TIMEOUT'])\n"
    )
    waits = ("OMP_WAIT_POLICY", "OPENBLAS_THREAD_TIMEOUT")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS") and k not in waits}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "1", "1", "PASSIVE", "4"]
