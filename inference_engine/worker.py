"""The model-owner worker: one thread runs every forward, fed in FIFO order; the event loop never blocks on it."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class ModelWorker:
    """Runs tensor work on a single dedicated thread."""

    def __init__(self, name: str = "kakeya-model") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        # Each counter is written by one thread only (submitted: the event loop; started: the worker).
        self._submitted = 0
        self._started = 0

    @property
    def backlog(self) -> int:
        """Calls submitted and not yet started on the worker thread."""
        return self._submitted - self._started

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `fn` on the worker thread and return its result.

        If the awaiting task is cancelled, the call still runs to completion before the cancellation propagates,
        so the caller never releases a session while the worker is mutating it.
        """
        return await self.run_cancellable(None, fn, *args, **kwargs)

    async def run_cancellable(
        self, on_cancel: Callable[[], None] | None, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """`run`, calling `on_cancel` as soon as the awaiting task is cancelled (before the call completes)."""
        loop = asyncio.get_running_loop()
        self._submitted += 1
        future = loop.run_in_executor(self._executor, functools.partial(self._call, fn, *args, **kwargs))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if on_cancel is not None:
                on_cancel()
            await asyncio.wait([future])
            raise

    def _call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        self._started += 1
        return fn(*args, **kwargs)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
