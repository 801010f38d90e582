"""--threads resolves to the measured default and limits the tensor libraries."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from inference_engine.config import ConfigError, ServerConfig
from inference_engine.threads import WAITS, default_wait, resolve_threads, usable_cores


def test_zero_threads_resolves_to_one_per_usable_core():
    assert resolve_threads(0, cores=16) == 16
    assert resolve_threads(0) == usable_cores()
    assert resolve_threads(3, cores=1) == 3, "an explicit count is taken as given"


def test_negative_threads_are_refused():
    with pytest.raises(ConfigError, match="threads must be >= 0"):
        ServerConfig(threads=-1)


def _applied(env_extra: dict[str, str]) -> list[str]:
    """What apply_threads(1, 'torch') leaves in a fresh process whose environment names no thread settings but
    `env_extra`: torch's intra- and inter-op threads and the variables OpenMP and OpenBLAS read."""
    code = (
        "from inference_engine.threads import apply_threads\n"
        "apply_threads(1, 'torch')\n"
        "import os, torch\n"
        "print(torch.get_num_threads(), torch.get_num_interop_threads(), os.environ['OPENBLAS_NUM_THREADS'],"
        " os.environ['OMP_WAIT_POLICY'], os.environ.get('GOMP_SPINCOUNT', '-'),"
        " os.environ['OPENBLAS_THREAD_TIMEOUT'])\n"
    )
    waits = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS") and k not in waits} | env_extra
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_apply_threads_sets_torch_and_the_blas_environment_in_a_fresh_process():
    spin = WAITS[default_wait()]
    expected_wait = [spin["OMP_WAIT_POLICY"], spin.get("GOMP_SPINCOUNT", "-")]
    assert _applied({}) == ["1", "1", "1", *expected_wait, "4"]


def test_the_default_wait_spins_briefly_on_linux():
    if sys.platform.startswith("linux"):
        assert WAITS[default_wait()] == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "10000"}
    else:
        assert default_wait() == "passive", "only GNU OpenMP bounds the spinning"


def test_a_wait_policy_from_the_environment_is_kept_whole():
    assert _applied({"OMP_WAIT_POLICY": "PASSIVE"})[3:5] == ["PASSIVE", "-"], "no spin count added to PASSIVE"
    assert _applied({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "5"})[3:5] == ["ACTIVE", "5"]


def test_the_server_command_sets_the_threads_before_torch_loads():
    """OpenMP reads its wait policy once, when torch loads: `serve` must apply it before importing the server."""
    code = (
        "import sys\n"
        "import inference_engine.cli as cli\n"
        "def record(count, backend):\n"
        "    print('torch' in sys.modules)\n"
        "    raise SystemExit(0)\n"
        "cli.apply_threads = record\n"
        "cli.run_server(cli.ServerConfig(port=0, metrics_port=-1))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", "torch was loaded before the threads were applied"
