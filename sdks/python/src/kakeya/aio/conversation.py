"""The asyncio `Converse` stream: one long-lived bidirectional call bound to one session."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

import grpc

from kakeya import _convert
from kakeya._generated import runtime_pb2 as pb
from kakeya.conversation import ConverseGeneration
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
    from kakeya.aio.client import AsyncSession


class AsyncConversation:
    """Commands on one `Converse` stream, run by the server in order (see `kakeya.Conversation`).

    Open it with `async with session.converse() as conversation:`. One command at a time: starting a command
    (or closing) while a generation is unfinished cancels it first and reads its remaining tokens into its stream.
    An error ends the conversation.
    """

    def __init__(self, session: AsyncSession, *, inter_token_timeout_s: float | None = None) -> None:
        self.session = session
        self._token_timeout_s = inter_token_timeout_s
        self._reply_timeout_s = session.client.timeout_s
        self._queue: asyncio.Queue[pb.ConverseRequest | None] = asyncio.Queue()
        self._call: Any = None
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._generation: ConverseGeneration | None = None
        self._failure: KakeyaError | None = None
        self._closed = False
        self.history_length = 0
        """History length as of the latest bind or append."""

    async def open(self) -> AsyncConversation:
        """Start the stream and bind it to the session."""
        if self._call is not None:
            raise InvalidArgument("the conversation is already open")
        client = self.session.client
        self._call = client.stub.Converse(self._requests(), metadata=self.session.metadata)
        try:
            bound = await self._command("bound", bind=pb.BindCommand(session_id=self.session.id))
        except KakeyaError:
            self._closed = True
            raise
        self.history_length = int(bound.bound.history_length)
        return self

    async def __aenter__(self) -> AsyncConversation:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def append(self, token_ids: Iterable[int]) -> int:
        """Append tokens to the session's history; returns the history length."""
        command = pb.AppendCommand(token_ids=_convert.token_ids(token_ids, "token_ids"))
        reply = await self._command("appended", append=command)
        self.history_length = int(reply.appended.history_length)
        return self.history_length

    async def generate(
        self,
        max_tokens: int,
        *,
        seed: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        stop_token_ids: Iterable[int] = (),
        controls: GenerationControls | None = None,
    ) -> AsyncConverseTokenStream:
        """Start a generation (parameters as in `Session.generate`) and return its token stream:
        `async for token in await conversation.generate(16)`."""
        fields = _convert.generate_fields(
            max_tokens=max_tokens,
            seed=seed,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=stop_token_ids,
            max_generate_tokens=(await self.session.client.model_info()).limits.max_generate_tokens,
            controls=controls,
        )
        async with self._lock:
            await self._settle()
            generation = ConverseGeneration(self._send(generate=pb.GenerateCommand(**fields)))  # type: ignore[arg-type]
            self._generation = generation
        self.session.last_generation = None
        return AsyncConverseTokenStream(self, generation)

    async def cancel(self) -> GenerationStats | None:
        """Cancel the unfinished generation, if any, and return its statistics once the server has stopped it."""
        generation = self._generation
        if generation is None:
            return None
        await self.stop(generation, wait=True)
        return generation.tally.stats

    async def close(self) -> None:
        """Finish the unfinished generation (cancelled), end the stream and wait for the server to close it."""
        if self._closed or self._call is None:
            self._closed = True
            return
        self._closed = True
        try:
            if self._failure is None:
                async with self._lock:
                    await self._settle()
                self._queue.put_nowait(None)
                async with asyncio.timeout(self._reply_timeout_s):
                    reply = await self._call.read()
                if reply is not grpc.aio.EOF:
                    raise ProtocolError(f"unexpected event after the last command: {reply}")
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        except TimeoutError:
            raise DeadlineExceeded(f"the server did not end the stream within {self._reply_timeout_s} s") from None
        finally:
            self._queue.put_nowait(None)
            self._call.cancel()

    # -- used by AsyncConverseTokenStream ----------------------------------------------------------------------
    async def next_token(self, generation: ConverseGeneration) -> int | None:
        """The generation's next token, or None once it has ended."""
        async with self._lock:
            while not generation.finished:
                reply = await self._read(generation.command_id, self._token_timeout_s, InterTokenTimeout)
                token = generation.tally.feed(reply.WhichOneof("event"), reply)
                if token is not None:
                    return token
                if generation.tally.stats is not None:
                    self._end(generation)
        return None

    async def stop(self, generation: ConverseGeneration, *, wait: bool) -> None:
        """Cancel `generation`; with `wait`, read its remaining events now, else at the next command."""
        if generation.finished or self._failure is not None or self._closed:
            return
        self.request_cancel(generation)
        if wait:
            async with self._lock:
                await self._settle()

    def request_cancel(self, generation: ConverseGeneration) -> None:
        """Send a cancel command for `generation` (once); safe to call from `__del__`."""
        if not generation.cancel_sent and not generation.finished and not self._closed:
            generation.cancel_sent = True
            self._queue.put_nowait(pb.ConverseRequest(command_id=next(self._ids), cancel=pb.CancelCommand()))

    # -- internals ---------------------------------------------------------------------------------------------
    async def _requests(self) -> AsyncIterator[pb.ConverseRequest]:
        while (request := await self._queue.get()) is not None:
            yield request

    async def _command(self, expected: str, **command: Any) -> Any:
        async with self._lock:
            await self._settle()
            command_id = self._send(**command)
            reply = await self._read(command_id, self._reply_timeout_s)
        if reply.WhichOneof("event") != expected:
            raise ProtocolError(f"expected a {expected!r} event, got {reply}")
        return reply

    def _send(self, **command: Any) -> int:
        if self._failure is not None:
            raise self._ended()
        if self._closed or self._call is None:
            raise InvalidArgument("the conversation is not open")
        command_id = next(self._ids)
        self._queue.put_nowait(pb.ConverseRequest(command_id=command_id, **command))
        return command_id

    def _ended(self) -> KakeyaError:
        assert self._failure is not None
        return type(self._failure)(f"the conversation has ended: {self._failure.message}", status=self._failure.status)

    async def _settle(self) -> None:
        """Cancel and drain the unfinished generation (caller holds the lock)."""
        generation = self._generation
        if generation is None:
            return
        self.request_cancel(generation)
        while not generation.finished:
            reply = await self._read(generation.command_id, self._reply_timeout_s)
            generation.tally.feed(reply.WhichOneof("event"), reply)
            if generation.tally.stats is not None:
                self._end(generation)

    def _fail(self, error: KakeyaError) -> KakeyaError:
        """Record why the conversation ended, end its request stream and cancel the call."""
        self._failure = error
        self._queue.put_nowait(None)
        self._call.cancel()
        return error

    def _end(self, generation: ConverseGeneration) -> None:
        generation.finished = True
        self._generation = None
        self.session.last_generation = generation.tally.stats

    async def _read(
        self, command_id: int, timeout_s: float | None, on_timeout: type[DeadlineExceeded] = DeadlineExceeded
    ) -> Any:
        if self._failure is not None:
            raise self._ended()
        try:
            async with asyncio.timeout(timeout_s):
                reply = await self._call.read()
        except TimeoutError:
            raise self._fail(on_timeout(f"no event within {timeout_s} s; the conversation was cancelled")) from None
        except asyncio.CancelledError:
            self._fail(KakeyaError("the task reading the conversation was cancelled"))
            raise
        except grpc.RpcError as error:
            raise self._fail(from_rpc_error(error)) from None
        if reply is grpc.aio.EOF:
            raise self._fail(ProtocolError("the server ended the Converse stream"))
        if reply.command_id != command_id:
            raise ProtocolError(f"expected an event for command {command_id}, got {reply}")
        return reply


class AsyncConverseTokenStream(AsyncIterator[int]):
    """The token ids of one generate command (see `kakeya.ConverseTokenStream`)."""

    def __init__(self, conversation: AsyncConversation, generation: ConverseGeneration) -> None:
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

    def __aiter__(self) -> AsyncConverseTokenStream:
        return self

    async def __anext__(self) -> int:
        token = await self.conversation.next_token(self._generation)
        if token is None:
            raise StopAsyncIteration
        return token

    async def cancel(self) -> GenerationStats | None:
        """Cancel the generation and wait for the server's final statistics."""
        await self.conversation.stop(self._generation, wait=True)
        return self.stats

    async def aclose(self) -> None:
        await self.conversation.stop(self._generation, wait=False)

    async def __aenter__(self) -> AsyncConverseTokenStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if hasattr(self, "_generation") and not self._generation.finished:
            with contextlib.suppress(Exception):  # the event loop is already closed
                self.conversation.request_cancel(self._generation)
