"""CPU threads of the tensor libraries, and how their idle threads wait.

A decode step of a small model is hundreds of short parallel operations. OpenMP threads that sleep between them
(`OMP_WAIT_POLICY=PASSIVE`) pay a wake-up each time, which on SmolLM2 halved the daemon's decode speed; threads that
spin long (GNU OpenMP's own default: 300,000 polls) wait on each other whenever other work takes a core. The
daemon's default, `spin`, polls briefly (GNU OpenMP's `GOMP_SPINCOUNT`, ten thousand polls) and then sleeps.
scripts/bench_threads.py measures each choice through the daemon, idle and under load (docs/operator-guide.md,
"CPU threads").
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Read by OpenMP, OpenBLAS (MLX on Linux), MKL and Accelerate when they start, so they are set before any loads.
_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
# How idle OpenMP threads wait, by name: the environment each choice sets. `spin` needs GNU OpenMP (torch's on
# Linux) to bound the spinning; elsewhere the daemon waits passively.
WAITS: dict[str, dict[str, str]] = {
    "spin": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "10000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}


def default_wait() -> str:
    """`spin` where torch's OpenMP is GNU's (Linux), which bounds it; `passive` elsewhere."""
    return "spin" if sys.platform.startswith("linux") else "passive"


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


def resolve_threads(requested: int, cores: int | None = None) -> int:
    """The thread count for `--threads requested`; 0 means one per usable core."""
    if requested > 0:
        return requested
    return max(1, cores if cores is not None else usable_cores())


def apply_threads(threads: int, backend: str) -> None:
    """Limit the tensor libraries to `threads` CPU threads whose idle threads wait as `default_wait()` says (unless
    the environment sets `OMP_WAIT_POLICY`) and whose OpenBLAS threads sleep at once (unless it sets
    `OPENBLAS_THREAD_TIMEOUT`). Call before the model loads: OpenMP and OpenBLAS read their environment once, when
    torch or the BLAS library loads."""
    for name in _ENV_VARS:
        os.environ[name] = str(threads)
    if "OMP_WAIT_POLICY" not in os.environ:
        for name, value in WAITS[default_wait()].items():
            os.environ.setdefault(name, value)
    # OpenBLAS's idle threads spin for 2^28 cycles by default; 2^4 puts them to sleep at once.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    if backend == "torch":
        import torch

        torch.set_num_threads(threads)
        # Inter-op threads can only be set before the first parallel op; the intra-op count holds regardless.
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(threads)


def on_a_passing_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a thread that ends when it returns (its exception raised here). GNU OpenMP keeps a pool of
    worker threads for every thread that ran a parallel operation until that thread ends, and once it manages more
    threads than there are cores it makes each idle worker sleep at once instead of polling: the engine thread's
    workers then slept and woke between the hundreds of short operations of every decode step (on SmolLM2 at 2,048
    tokens, 195 context switches a token and 1.2x the time a token took in a process with one pool). Loading the
    model here leaves the engine thread's pool the only one."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn(*args))
        except BaseException as exc:  # re-raised on the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="kakeya-load", daemon=True)  # an interrupted start need not wait
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]
