"""--threads resolves to the measured default and limits the tensor libraries; the model loads on a thread that
ends, so that the engine thread's OpenMP pool is the only one."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from inference_engine.config import ConfigError, ServerConfig
from inference_engine.threads import WAITS, default_wait, on_a_passing_thread, resolve_threads, usable_cores


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


def _serve_with(setup: str) -> str:
    """What `serve` (`cli.run_server` with default options) prints in a fresh process after `setup` replaced
    some of what it calls with a function that prints and exits."""
    code = f"import sys, threading\nimport inference_engine.cli as cli\n{setup}\n"
    code += "cli.run_server(cli.ServerConfig(port=0, metrics_port=-1))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_server_command_sets_the_threads_before_torch_loads():
    """OpenMP reads its wait policy once, when torch loads: `serve` must apply it before importing the server."""
    setup = "def record(count, backend):\n    print('torch' in sys.modules)\n    raise SystemExit(0)\n"
    printed = _serve_with(setup + "cli.apply_threads = record")
    assert printed == "False", "torch was loaded before the threads were applied"


def test_a_passing_thread_returns_or_raises_what_the_function_does_and_ends():
    seen = []

    def work(x: int) -> int:
        seen.append(threading.current_thread())
        return x + 1

    assert on_a_passing_thread(work, 1) == 2
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()

    def fail() -> None:
        raise KeyError("from the thread")

    with pytest.raises(KeyError, match="from the thread"):
        on_a_passing_thread(fail)


_POOLS = """
import os, sys, time
from inference_engine.threads import apply_threads, on_a_passing_thread
apply_threads(2, "torch")
import torch
def threads():
    return len(os.listdir("/proc/self/task"))
def load():
    a = torch.randn(1024, 1024)
    (a @ a).sum()
before = threads()
if sys.argv[1] == "passing":
    on_a_passing_thread(load)
else:
    load()  # on the main thread, which keeps its OpenMP pool
deadline = time.monotonic() + 10
while threads() > before and time.monotonic() < deadline:  # a finished pool's workers end soon after its thread
    time.sleep(0.05)
print(threads() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GNU OpenMP's pools are torch's on Linux only")
def test_a_model_loaded_on_a_passing_thread_leaves_no_openmp_workers_behind():
    """GNU OpenMP keeps a pool of workers for each thread that ran a parallel operation until the thread ends; with
    more of its threads than cores it makes every idle worker sleep at once, which slowed the engine thread's steps.
    Work done on a passing thread leaves none behind."""

    def workers_left(where: str) -> int:
        env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS") and "OMP" not in k}
        done = subprocess.run(
            [sys.executable, "-c", _POOLS, where], capture_output=True, text=True, timeout=300, env=env
        )
        assert done.returncode == 0, done.stderr
        return int(done.stdout.split()[-1])

    assert workers_left("main") == 1, "the main thread's pool keeps its worker (the case the passing thread avoids)"
    assert workers_left("passing") == 0


def test_the_server_command_loads_the_model_on_a_passing_thread():
    setup = (
        "import inference_engine.server as server\n"
        "cli.resolve_model = lambda model, cache: type('M', (), {'directory': model, 'source': model})()\n"
        "def record(config):\n"
        "    print(threading.current_thread() is threading.main_thread())\n"
        "    raise SystemExit(0)\n"
        "server.load_runtime = record"
    )
    assert _serve_with(setup) == "False", "the model loaded on the main thread, whose OpenMP pool stays"
