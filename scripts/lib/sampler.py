"""A thread that samples something every few milliseconds while a measured part of a benchmark runs."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Self


def rss_bytes(pid: int) -> int:
    """The process's resident set size now (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class PeriodicSampler:
    """Calls `sample()` every `interval_s` on its own thread between `__enter__` and `__exit__`."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval_s)
