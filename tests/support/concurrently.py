"""Calls run on threads released together, for tests of concurrent sessions."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def concurrently(calls: list[Callable[[], Any]], timeout_s: float = 240.0) -> list[Any]:
    """Run the calls on threads released together; returns each one's result or the exception it raised."""
    results: list[Any] = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = calls[index]()
        except Exception as exc:
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    return results
