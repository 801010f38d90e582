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
import os, sys, threading
from inference_engine.threads import apply_threads, on_a_passing_thread
apply_threads(2, "torch")
import torch
def load():
    a = torch.randn(1024, 1024)
    (a @ a).sum()
if sys.argv[1] == "passing":
    on_a_passing_thread(load)
else:
    load()  # on the main thread, which keeps its OpenMP pool
def switches():
    total = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/status") as f:
                total += int(f.read().split("voluntary_ctxt_switches:")[1].split()[0])
        except OSError:
            pass
    return total
def steps():
    x, w = torch.randn(4, 576), torch.randn(1536, 576)
    torch.nn.functional.linear(x, w)
    before = switches()
    for _ in range(2000):
        torch.nn.functional.linear(x, w).sum()
    print(switches() - before)
engine = threading.Thread(target=steps)
engine.start()
engine.join()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GNU OpenMP's pools are torch's on Linux only")
@pytest.mark.skipif(usable_cores() != 2, reason="the pools outnumber the cores only where there are 2")
def test_a_model_loaded_on_a_passing_thread_leaves_the_engine_threads_openmp_workers_polling():
    def context_switches(where: str) -> int:
        env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS") and "OMP" not in k}
        done = subprocess.run(
            [sys.executable, "-c", _POOLS, where], capture_output=True, text=True, timeout=300, env=env
        )
        assert done.returncode == 0, done.stderr
        return int(done.stdout.split()[-1])

    kept = context_switches("main")
    if kept < 1000:
        pytest.skip(f"this OpenMP does not put its workers to sleep with a second pool ({kept} switches)")
    # With the main thread's pool gone, the stepping thread's worker polls between its 2,000 operations instead of
    # sleeping after each (about 2,000 switches with both pools).
    assert context_switches("passing") < kept / 4


def test_the_server_command_loads_the_model_on_a_passing_thread():
    code = (
        "import threading\n"
        "import inference_engine.cli as cli\n"
        "import inference_engine.server as server\n"
        "cli.resolve_model = lambda model, cache: type('M', (), {'directory': model, 'source': model})()\n"
        "def record(config):\n"
        "    print(threading.current_thread() is threading.main_thread())\n"
        "    raise SystemExit(0)\n"
        "server.load_runtime = record\n"
        "cli.run_server(cli.ServerConfig(port=0, metrics_port=-1))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", "the model loaded on the main thread, whose OpenMP pool stays"
