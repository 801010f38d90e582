"""Pieces shared by the token streams: the per-generation tally of events, what every stream tells of it, the part
of `TokenStream` and `AsyncTokenStream` that does not wait, and the sync inter-event watchdog."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kakeya import _convert
from kakeya.errors import InterTokenTimeout, ProtocolError
from kakeya.types import GenerationStats, TokenLogprobs

if TYPE_CHECKING:
    from kakeya._core import SessionCore

SessionT = TypeVar("SessionT", bound="SessionCore[Any, Any, Any]")


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


class TokensSoFar:
    """What a token stream tells of its generation: the tokens, log-probabilities and truncation received so far, and
    the statistics once it has ended."""

    _tally: Tally

    @property
    def tokens(self) -> list[int]:
        """Tokens received so far; once a conversation's stream has ended, exactly the tokens it added to the
        history."""
        return list(self._tally.tokens)

    @property
    def logprobs(self) -> list[TokenLogprobs]:
        """Log-probabilities of the tokens received so far (one per token; empty unless the generation asked for
        them with `GenerationControls(logprobs=True)`)."""
        return list(self._tally.logprobs)

    @property
    def stats(self) -> GenerationStats | None:
        """The generation's statistics once it has ended (see `GenerationStats.server_reported`)."""
        return self._tally.stats

    @property
    def truncated_token_count(self) -> int:
        """History positions no longer resident when the generation started (0 when none were evicted)."""
        return self._tally.truncated_token_count


class GenerationStream(TokensSoFar, Generic[SessionT]):
    """The part of a `Generate` call's token stream that does not wait: its tally, cancelling, and its end."""

    def __init__(self, session: SessionT, call: Any, inter_token_timeout_s: float | None) -> None:
        self.session = session
        self._call = call
        self._tally = Tally()
        self._finished = False
        self._timeout_s = inter_token_timeout_s

    def cancel(self) -> None:
        """Cancel the generation on the server (no-op once the stream has ended)."""
        if not self._finished:
            self._finish(self._tally.abandoned())
            self._call.cancel()

    def __del__(self) -> None:
        if not getattr(self, "_finished", True):
            with contextlib.suppress(Exception):  # at shutdown the channel or the event loop is already gone
                self.cancel()

    def _accept(self, reply: Any) -> int | None:
        """Record one reply; returns its token, or None (once the reply was the final message, the stream ends)."""
        token = self._tally.feed(reply.WhichOneof("payload"), reply)
        if token is None and self._tally.stats is not None:
            self._finish(self._tally.stats)
        return token

    def _finish(self, stats: GenerationStats | None) -> None:
        self._finished = True
        self._tally.stats = stats
        self.session.last_generation = stats

    def _cut_off(self) -> ProtocolError:
        """End the stream that the server closed without its final message."""
        self._finish(None)
        return ProtocolError("the Generate stream ended without its final message")

    def _timed_out(self) -> InterTokenTimeout:
        return InterTokenTimeout(
            f"no event within inter_token_timeout_s={self._timeout_s} on session {self.session.id!r}; "
            "the generation was cancelled"
        )


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
