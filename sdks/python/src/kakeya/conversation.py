"""The synchronous `Converse` stream: one long-lived bidirectional call bound to one session."""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from kakeya import _convert
from kakeya._generated import runtime_pb2 as pb
from kakeya._stream import Tally, Watchdog
from kakeya.errors import (
    DeadlineExceeded,
    InterTokenTimeout,
    InvalidArgument,
    KakeyaError,
    ProtocolError,
    from_rpc_error,
)
from kakeya.types import GenerationControls, GenerationStats, TokenLogprobs

if TYPE_CHECKING:
    from kakeya.client import Session


@dataclass(eq=False)
class ConverseGeneration:
    """State of one generate command of a conversation (shared by the sync and asyncio conversations)."""

    command_id: int
    tally: Tally = field(default_factory=Tally)
    cancel_sent: bool = False
    finished: bool = False


class Conversation:
    """Commands on one `Converse` stream, run by the server in order: `append`, `generate`, `cancel`.

    Every token streamed before a generation's final message is in the session's history, so a cancelled
    generation's stream holds exactly the tokens it added. One command at a time: starting a command (or closing)
    while a generation is unfinished cancels it first and reads its remaining tokens into its stream. An error
    ends the conversation (the server closes the stream). Use it as a context manager, or call `close()`.
    """

    def __init__(self, session: Session, *, inter_token_timeout_s: float | None = None) -> None:
        self.session = session
        client = session.client
        self._requests: queue.SimpleQueue[pb.ConverseRequest | None] = queue.SimpleQueue()
        self._call = client.stub.Converse(iter(self._requests.get, None), metadata=session.metadata)
        self._token_timeout_s = inter_token_timeout_s
        self._reply_timeout_s = client.timeout_s
        self._watchdog = Watchdog(self._call.cancel)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._generation: ConverseGeneration | None = None
        self._failure: KakeyaError | None = None
        self._closed = False
        try:
            bound = self._command("bound", bind=pb.BindCommand(session_id=session.id))
        except KakeyaError:
            self._closed = True
            raise
        self.history_length = int(bound.bound.history_length)
        """History length as of the latest bind or append."""

    def __enter__(self) -> Conversation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def append(self, token_ids: Iterable[int]) -> int:
        """Append tokens to the session's history; returns the history length."""
        command = pb.AppendCommand(token_ids=_convert.token_ids(token_ids, "token_ids"))
        reply = self._command("appended", append=command)
        self.history_length = int(reply.appended.history_length)
        return self.history_length

    def generate(
        self,
        max_tokens: int,
        *,
        seed: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        stop_token_ids: Iterable[int] = (),
        controls: GenerationControls | None = None,
    ) -> ConverseTokenStream:
        """Start a generation (parameters as in `Session.generate`); the conversation's `inter_token_timeout_s`
        bounds each wait for its next event."""
        fields = _convert.generate_fields(
            max_tokens=max_tokens,
            seed=seed,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=stop_token_ids,
            max_generate_tokens=self.session.client.model_info().limits.max_generate_tokens,
            controls=controls,
        )
        with self._lock:
            self._settle()
            generation = ConverseGeneration(self._send(generate=pb.GenerateCommand(**fields)))  # type: ignore[arg-type]
            self._generation = generation
        self.session.last_generation = None
        return ConverseTokenStream(self, generation)

    def cancel(self) -> GenerationStats | None:
        """Cancel the unfinished generation, if any, and return its statistics once the server has stopped it."""
        generation = self._generation
        if generation is None:
            return None
        self._request_cancel(generation)
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
                self._requests.put(None)
                self._watchdog.arm(self._reply_timeout_s)
                for reply in self._call:
                    raise ProtocolError(f"unexpected event after the last command: {reply}")
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        finally:
            self._requests.put(None)
            self._watchdog.stop()
            self._call.cancel()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._requests.put(None)
            self._watchdog.stop()

    # -- used by ConverseTokenStream ---------------------------------------------------------------------------
    def next_token(self, generation: ConverseGeneration) -> int | None:
        """The generation's next token, or None once it has ended."""
        with self._lock:
            while not generation.finished:
                reply = self._read(generation.command_id, self._token_timeout_s, InterTokenTimeout)
                token = generation.tally.feed(reply.WhichOneof("event"), reply)
                if token is not None:
                    return token
                if generation.tally.stats is not None:
                    self._end(generation)
        return None

    def stop(self, generation: ConverseGeneration, *, wait: bool) -> None:
        """Cancel `generation`; with `wait`, read its remaining events now, else at the next command."""
        if generation.finished or self._failure is not None or self._closed:
            return
        self._request_cancel(generation)
        if wait:
            with self._lock:
                self._settle()

    # -- internals ---------------------------------------------------------------------------------------------
    def _request_cancel(self, generation: ConverseGeneration) -> None:
        if not generation.cancel_sent and not generation.finished:
            generation.cancel_sent = True
            self._requests.put(pb.ConverseRequest(command_id=next(self._ids), cancel=pb.CancelCommand()))

    def _command(self, expected: str, **command: Any) -> Any:
        with self._lock:
            self._settle()
            command_id = self._send(**command)
            reply = self._read(command_id, self._reply_timeout_s)
        if reply.WhichOneof("event") != expected:
            raise ProtocolError(f"expected a {expected!r} event, got {reply}")
        return reply

    def _send(self, **command: Any) -> int:
        if self._failure is not None:
            raise self._ended()
        if self._closed:
            raise InvalidArgument("the conversation is closed")
        command_id = next(self._ids)
        self._requests.put(pb.ConverseRequest(command_id=command_id, **command))
        return command_id

    def _ended(self) -> KakeyaError:
        assert self._failure is not None
        return type(self._failure)(f"the conversation has ended: {self._failure.message}", status=self._failure.status)

    def _settle(self) -> None:
        """Cancel and drain the unfinished generation (caller holds the lock)."""
        generation = self._generation
        if generation is None:
            return
        self._request_cancel(generation)
        while not generation.finished:
            reply = self._read(generation.command_id, self._reply_timeout_s)
            generation.tally.feed(reply.WhichOneof("event"), reply)
            if generation.tally.stats is not None:
                self._end(generation)

    def _fail(self, error: KakeyaError) -> KakeyaError:
        """Record why the conversation ended and release its request stream and watchdog."""
        self._failure = error
        self._requests.put(None)
        self._watchdog.stop()
        return error

    def _end(self, generation: ConverseGeneration) -> None:
        generation.finished = True
        self._generation = None
        self.session.last_generation = generation.tally.stats

    def _read(
        self, command_id: int, timeout_s: float | None, on_timeout: type[DeadlineExceeded] = DeadlineExceeded
    ) -> Any:
        if self._failure is not None:
            raise self._ended()
        self._watchdog.arm(timeout_s)
        try:
            reply = next(self._call)
        except StopIteration:
            raise self._fail(ProtocolError("the server ended the Converse stream")) from None
        except grpc.RpcError as error:
            if self._watchdog.expired:
                raise self._fail(on_timeout(f"no event within {timeout_s} s; the conversation was cancelled")) from None
            raise self._fail(from_rpc_error(error)) from None
        finally:
            self._watchdog.arm(None)
        if reply.command_id != command_id:
            raise ProtocolError(f"expected an event for command {command_id}, got {reply}")
        return reply


class ConverseTokenStream(Iterator[int]):
    """The token ids of one generate command, as they arrive. Stopping early (break, `close()`, leaving a `with`
    block) cancels the generation; its remaining tokens are read at the conversation's next command, or at once
    by `cancel()`."""

    def __init__(self, conversation: Conversation, generation: ConverseGeneration) -> None:
        self.conversation = conversation
        self._generation = generation

    @property
    def tokens(self) -> list[int]:
        """Tokens received so far; once the stream has ended, exactly the tokens it added to the history."""
        return list(self._generation.tally.tokens)

    @property
    def logprobs(self) -> list[TokenLogprobs]:
        """Log-probabilities of the tokens received so far (one per token; empty unless the generation asked for
        them with `GenerationControls(logprobs=True)`)."""
        return list(self._generation.tally.logprobs)

    @property
    def stats(self) -> GenerationStats | None:
        return self._generation.tally.stats

    @property
    def truncated_token_count(self) -> int:
        return self._generation.tally.truncated_token_count

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

    def __del__(self) -> None:
        if hasattr(self, "_generation") and not self._generation.finished:
            with contextlib.suppress(Exception):  # interpreter shutdown
                self.close()
