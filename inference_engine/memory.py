"""Handing memory the daemon freed back to the system.

Tensors and numpy arrays are allocated by the C library's `malloc`. glibc keeps what a program frees for its next
allocations, per thread arena, and places large blocks in the heap once the program has freed a few (its mmap
threshold grows up to 32 MiB), so a generation's working storage, freed when its session parks, can stay in the
process's resident set long after: the KV budget then bounds what sessions hold but not the memory the daemon
keeps. `malloc_trim(0)` returns every arena's free pages to the system. The daemon calls it after a session parks
or closes, and after a forward that prefilled (caches grow then, and a chunk's working storage is largest), on the
engine thread between two steps; never after a decode step, whose freed storage the next step reuses at once.
Where the C library has no `malloc_trim` (macOS, musl) nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable


def release_free_memory() -> bool:
    """Return the C library's free pages to the system; whether the library could."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl has no malloc_trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim
