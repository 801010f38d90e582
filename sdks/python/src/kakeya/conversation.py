"""The synchronous `Converse` stream: one long-lived bidirectional call bound to one session."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Unpack

import grpc

from kakeya import _convert
from kakeya._converse import ConversationCore, ConverseGeneration, ConverseStreamCore
from kakeya._generated import runtime_pb2 as pb
from kakeya._stream import Watchdog
from kakeya.errors import DeadlineExceeded, InterTokenTimeout, KakeyaError, ProtocolError, from_rpc_error
from kakeya.types import GenerationStats, SamplingOptions

if TYPE_CHECKING:
    from kakeya.client import Session


class Conversation(ConversationCore["Session"]):
    """Commands on one `Converse` stream, run by the server in order: `append`, `generate`, `cancel`.

    Every token streamed before a generation's final message is in the session's history, so a cancelled
    generation's stream holds exactly the tokens it added. One command at a time: starting a command (or closing)
    while a generation is unfinished cancels it first and reads its remaining tokens into its stream. An error
    ends the conversation (the server closes the stream). Use it as a context manager, or call `close()`.
    """

    def __init__(self, session: Session, *, inter_token_timeout_s: float | None = None) -> None:
        requests: queue.SimpleQueue[pb.ConverseRequest | None] = queue.SimpleQueue()
        super().__init__(session, requests, inter_token_timeout_s)
        self._call = session.client.stub.Converse(iter(requests.get, None), metadata=session.metadata)
        self._watchdog = Watchdog(self._call.cancel)
        self._lock = threading.Lock()
        try:
            bound = self._command("bound", bind=pb.BindCommand(session_id=session.id))
        except KakeyaError:
            self._closed = True
            raise
        self.history_length = int(bound.bound.history_length)

    def __enter__(self) -> Conversation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def append(self, token_ids: Iterable[int]) -> int:
        """Append tokens to the session's history; returns the history length."""
        command = pb.AppendCommand(token_ids=_convert.token_ids(token_ids, "token_ids"))
        self.history_length = int(self._command("appended", append=command).appended.history_length)
        return self.history_length

    def generate(self, max_tokens: int, **sampling: Unpack[SamplingOptions]) -> ConverseTokenStream:
        """Start a generation (`max_tokens` and the `SamplingOptions` as in `Session.generate`); the conversation's
        `inter_token_timeout_s` bounds each wait for its next event."""
        limit = self.session.client.model_info().limits.max_generate_tokens
        fields = _convert.generate_fields(max_tokens=max_tokens, max_generate_tokens=limit, **sampling)
        with self._lock:
            self._settle()
            generation = self._begin(fields)
        return ConverseTokenStream(self, generation)

    def cancel(self) -> GenerationStats | None:
        """Cancel the unfinished generation, if any, and return its statistics once the server has stopped it."""
        generation = self._generation
        if generation is None:
            return None
        self.request_cancel(generation)
        with self._lock:
            self._settle()
        return self.session.last_generation

    def close(self) -> None:
        """Finish the unfinished generation (cancelled), end the stream and wait for the server to close it."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._failure is None:
                with self._lock:
                    self._settle()
                self._outbox.put_nowait(None)
                self._watchdog.arm(self._reply_timeout_s)
                for reply in self._call:
                    raise ProtocolError(f"unexpected event after the last command: {reply}")
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        finally:
            self._stop_call()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._outbox.put_nowait(None)
            self._watchdog.stop()

    # -- used by ConverseTokenStream ---------------------------------------------------------------------------
    def next_token(self, generation: ConverseGeneration) -> int | None:
        """The generation's next token, or None once it has ended."""
        with self._lock:
            while not generation.finished:
                reply = self._read(generation.command_id, self._token_timeout_s, InterTokenTimeout)
                if (token := self._feed(generation, reply)) is not None:
                    return token
        return None

    def stop(self, generation: ConverseGeneration, *, wait: bool) -> None:
        """Cancel `generation`; with `wait`, read its remaining events now, else at the next command."""
        if self._stopping(generation) and wait:
            with self._lock:
                self._settle()

    # -- internals ---------------------------------------------------------------------------------------------
    def _command(self, expected: str, **command: Any) -> Any:
        with self._lock:
            self._settle()
            reply = self._read(self._send(**command), self._reply_timeout_s)
        return self._expect(reply, expected)

    def _settle(self) -> None:
        """Cancel and drain the unfinished generation (caller holds the lock)."""
        generation = self._cancel_unfinished()
        while generation is not None and not generation.finished:
            self._feed(generation, self._read(generation.command_id, self._reply_timeout_s))

    def _read(
        self, command_id: int, timeout_s: float | None, on_timeout: type[DeadlineExceeded] = DeadlineExceeded
    ) -> Any:
        if self._failure is not None:
            raise self._ended()
        self._watchdog.arm(timeout_s)
        try:
            reply = next(self._call)
        except StopIteration:
            raise self._cut_off() from None
        except grpc.RpcError as error:
            if self._watchdog.expired:
                raise self._stalled(timeout_s, on_timeout) from None
            raise self._fail(from_rpc_error(error)) from None
        finally:
            self._watchdog.arm(None)
        return self._checked(reply, command_id)

    def _stop_call(self) -> None:
        super()._stop_call()
        self._watchdog.stop()


class ConverseTokenStream(ConverseStreamCore[Conversation], Iterator[int]):
    """The token ids of one generate command, as they arrive. Stopping early (break, `close()`, leaving a `with`
    block) cancels the generation; its remaining tokens are read at the conversation's next command, or at once
    by `cancel()`."""

    def __iter__(self) -> ConverseTokenStream:
        return self

    def __next__(self) -> int:
        token = self.conversation.next_token(self._generation)
        if token is None:
            raise StopIteration
        return token

    def cancel(self) -> GenerationStats | None:
        """Cancel the generation and wait for the server's final statistics."""
        self.conversation.stop(self._generation, wait=True)
        return self.stats

    def close(self) -> None:
        self.conversation.stop(self._generation, wait=False)

    def __enter__(self) -> ConverseTokenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
