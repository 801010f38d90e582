"""Pieces shared by the token streams: the per-generation tally of events and the sync inter-event watchdog."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from kakeya import _convert
from kakeya.errors import ProtocolError
from kakeya.types import GenerationStats, TokenLogprobs


class Tally:
    """What one generation has delivered so far: tokens, the truncation notice, and the final statistics.

    `GenerateResponse.payload` and the generation events of `ConverseResponse.event` share their field names
    (`token_id`, `truncated`, `done`), so one tally reads both.
    """

    __slots__ = ("logprobs", "stats", "tokens", "truncated_token_count")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprobs] = []  # one per token when the generation asked for them
        self.truncated_token_count = 0
        self.stats: GenerationStats | None = None

    def feed(self, kind: str | None, reply: Any) -> int | None:
        """Record one event; returns the token id for a token event, else None."""
        if kind == "token_id":
            token = int(reply.token_id)
            self.tokens.append(token)
            return token
        if kind == "scored_token":
            scored = _convert.token_logprobs(reply.scored_token)
            self.tokens.append(scored.token_id)
            self.logprobs.append(scored)
            return scored.token_id
        if kind == "truncated":
            self.truncated_token_count = int(reply.truncated.dropped_token_count)
            return None
        if kind == "done":
            self.stats = _convert.generation_stats(reply.done, self.truncated_token_count)
            return None
        raise ProtocolError(f"unexpected event {kind!r} in a token stream")

    def abandoned(self) -> GenerationStats:
        return _convert.abandoned_stats(len(self.tokens), self.truncated_token_count)


class Watchdog:
    """Calls `on_expire` once when the armed deadline passes with no re-arm; one thread for the whole call.

    Re-arming on every event is cheap: the thread only wakes when a deadline is reached or shortened.
    """

    def __init__(self, on_expire: Callable[[], object]) -> None:
        self._on_expire = on_expire
        self._cond = threading.Condition()
        self._deadline = math.inf
        self._stopped = False
        self.expired = False
        self._thread = threading.Thread(target=self._run, name="kakeya-watchdog", daemon=True)
        self._thread.start()

    def arm(self, timeout_s: float | None) -> None:
        """Expire `timeout_s` from now (None: never, until re-armed)."""
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            shorter = deadline < self._deadline
            self._deadline = deadline
            if shorter:
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    self.expired = True
                    break
                self._cond.wait(None if math.isinf(remaining) else remaining)
        if self.expired:
            self._on_expire()
