"""CPU threads of the tensor libraries.

OpenMP's default is one thread per core that spin-waits at every barrier. On a machine whose cores are busy with other
work the spinning threads wait on each other and generation slows several-fold; waiting passively removes that.
scripts/bench_threads.py measured it (docs/operator-guide.md, "CPU threads").
"""

from __future__ import annotations

import contextlib
import os

# Read by OpenMP, OpenBLAS (MLX on Linux), MKL and Accelerate when they start, so they are set before any loads.
_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


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
    """Limit the tensor libraries to `threads` CPU threads that wait passively (unless `OMP_WAIT_POLICY` and
    `OPENBLAS_THREAD_TIMEOUT` are set). Call before the model loads: OpenMP and OpenBLAS read their environment
    once, when torch or the BLAS library loads."""
    for name in _ENV_VARS:
        os.environ[name] = str(threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # OpenBLAS's idle threads spin for 2^28 cycles by default; 2^4 puts them to sleep at once.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    if backend == "torch":
        import torch

        torch.set_num_threads(threads)
        # Inter-op threads can only be set before the first parallel op; the intra-op count holds regardless.
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(threads)
