"""CPU threads of the tensor libraries. Each library otherwise starts one thread per core, and on a machine whose
cores are busy with other work those threads wait on each other: generation then slows several-fold."""

from __future__ import annotations

import contextlib
import os

# Read by OpenMP, OpenBLAS (MLX on Linux), MKL and Accelerate when they start, so they are set before any loads.
_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")

DEFAULT_MAX_THREADS = 2
"""`--threads 0` uses min(this, cores): scripts/bench_threads.py measured decode of small models fastest with one or
two threads, and several-fold slower with a thread per core once other processes keep the cores busy."""


def resolve_threads(requested: int, cpu_count: int | None = None) -> int:
    """The thread count for `--threads requested` (0: the measured default for this machine)."""
    if requested > 0:
        return requested
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, min(DEFAULT_MAX_THREADS, cores))


def apply_threads(threads: int, backend: str) -> None:
    """Limit the tensor libraries to `threads` CPU threads. Call before the model loads."""
    for name in _ENV_VARS:
        os.environ[name] = str(threads)
    if backend == "torch":
        import torch

        torch.set_num_threads(threads)
        # Inter-op threads can only be set before the first parallel op; the intra-op count holds regardless.
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(threads)
