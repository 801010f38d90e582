"""Memory the daemon freed goes back to the system: glibc keeps freed heap pages below a live block, and
`release_free_memory` returns them (the daemon calls it after a session parks or closes, and after a forward that
prefilled)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_PROGRAM = textwrap.dedent(
    """
    from inference_engine.memory import release_free_memory

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    blocks = [bytearray(64 * 1024) for _ in range(2000)]  # 125 MiB of heap blocks, below the mmap threshold
    pinned = bytearray(64 * 1024)  # a live block above them: freeing them cannot shrink the heap from its top
    del blocks
    freed = rss()
    trimmed = release_free_memory()
    print(freed, rss(), trimmed)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's; elsewhere nothing is done")
def test_freed_heap_pages_below_a_live_block_go_back_to_the_system():
    # A fresh interpreter, so the heap holds only these blocks and the measure is not the test runner's.
    out = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True, check=True).stdout.split()
    freed, trimmed, called = int(out[0]), int(out[1]), out[2]
    assert called == "True"
    assert freed - trimmed > 100 * 2**20  # of the 125 MiB freed, glibc had kept them resident until the trim
