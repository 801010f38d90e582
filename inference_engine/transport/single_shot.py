"""One HTTP completion as a single-shot session: create it, append the prompt, generate text, close it.

No session outlives its request and no session id leaves the server. `close()` is idempotent and is called by the
transport whatever happened (success, error, stop string, client disconnect).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Sequence
from contextlib import suppress

from inference_engine.domain import CreateParams, DoneEvent, GenerateEvent, GenerateParams, StopReason, TokenEvent
from inference_engine.errors import InvalidArgument, SessionNotFound
from inference_engine.runtime import Runtime
from inference_engine.transport.text_codec import TextCodec, TextDecoder

log = logging.getLogger(__name__)


class SingleShotGeneration:
    """Text generation for one request over a session of its own.

    After `text()` is exhausted, `stop_string_hit` says whether a stop string ended the text, else `stop_reason`
    is why the generation ended; `completion_tokens` counts the tokens generated up to that point (the
    end-of-sequence token, or the token that completed the stop string, included).
    """

    def __init__(
        self,
        runtime: Runtime,
        codec: TextCodec,
        prompt_token_ids: Sequence[int],
        params: GenerateParams,
        *,
        stop: Sequence[str] = (),
        label: str = "http-shim",
    ) -> None:
        self._runtime = runtime
        self._codec = codec
        self._prompt = list(prompt_token_ids)
        self._params = params
        self._decoder: TextDecoder = codec.decoder(stop)
        self._label = label
        self.cancel = asyncio.Event()
        self.client_disconnected = False
        self._session_id: str | None = None
        self._events: AsyncGenerator[GenerateEvent, None] | None = None
        self._first: GenerateEvent | None = None
        self.stop_reason: StopReason | None = None
        self.stop_string_hit = False
        self.completion_tokens = 0

    def disconnect(self) -> None:
        """The HTTP client went away: stop the generation after its current step."""
        self.client_disconnected = True
        self.cancel.set()

    @property
    def prompt_tokens(self) -> int:
        return len(self._prompt)

    async def start(self) -> None:
        """Create the session, append the prompt and wait for the first generation event, so that every error up
        to the first token (limits, queue deadline, shutdown) is raised here, before any response is sent."""
        if not self._prompt:
            raise InvalidArgument("the prompt is empty: it must hold at least one token")
        params = CreateParams(label=self._label, eos_token_ids=self._codec.eos_token_ids, single_shot=True)
        self._session_id, _ = await self._runtime.create_session(params)
        await self._runtime.append(self._session_id, self._prompt)
        self._events = self._runtime.generate(self._session_id, self._params, cancel=self.cancel)
        self._first = await anext(self._events)

    async def text(self) -> AsyncGenerator[str, None]:
        """Yield the generated text in non-empty pieces until EOS, a stop string, a limit or a cancellation."""
        if self._events is None or self._first is None:
            raise RuntimeError("start() must succeed before text()")
        event: GenerateEvent | None = self._first
        while event is not None:
            if isinstance(event, TokenEvent):
                self.completion_tokens += 1
                piece = self._decoder.push(event.token_id)
                if piece:
                    yield piece
                if self._decoder.stopped:
                    self.stop_string_hit = True
                    return
            elif isinstance(event, DoneEvent):
                self.stop_reason = event.stats.stop_reason
                break
            event = await anext(self._events, None)
        tail = self._decoder.finish()
        self.stop_string_hit = self._decoder.stopped
        if tail:
            yield tail

    async def close(self) -> None:
        """Stop the generation if it still runs and free the session."""
        events, self._events = self._events, None
        if events is not None:
            await events.aclose()
        session_id, self._session_id = self._session_id, None
        if session_id is not None:
            with suppress(SessionNotFound):  # already freed: failed on an invariant, or evicted
                await self._runtime.close_session(session_id)
