"""The asyncio `Converse` stream: one long-lived bidirectional call bound to one session."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any, Unpack

import grpc

from kakeya import _convert
from kakeya._converse import ConversationCore, ConverseGeneration, ConverseStreamCore
from kakeya._generated import runtime_pb2 as pb
from kakeya.errors import (
    DeadlineExceeded,
    InterTokenTimeout,
    InvalidArgument,
    KakeyaError,
    ProtocolError,
    from_rpc_error,
)
from kakeya.types import GenerationStats, SamplingOptions

if TYPE_CHECKING:
    from kakeya.aio.client import AsyncSession


class AsyncConversation(ConversationCore["AsyncSession"]):
    """Commands on one `Converse` stream, run by the server in order (see `kakeya.Conversation`).

    Open it with `async with session.converse() as conversation:`. One command at a time: starting a command
    (or closing) while a generation is unfinished cancels it first and reads its remaining tokens into its stream.
    An error ends the conversation.
    """

    def __init__(self, session: AsyncSession, *, inter_token_timeout_s: float | None = None) -> None:
        self._queue: asyncio.Queue[pb.ConverseRequest | None] = asyncio.Queue()
        super().__init__(session, self._queue, inter_token_timeout_s)
        self._lock = asyncio.Lock()

    async def open(self) -> AsyncConversation:
        """Start the stream and bind it to the session."""
        if self._call is not None:
            raise InvalidArgument("the conversation is already open")
        self._call = self.session.client.stub.Converse(self._requests(), metadata=self.session.metadata)
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
        self.history_length = int((await self._command("appended", append=command)).appended.history_length)
        return self.history_length

    async def generate(self, max_tokens: int, **sampling: Unpack[SamplingOptions]) -> AsyncConverseTokenStream:
        """Start a generation (`max_tokens` and the `SamplingOptions` as in `Session.generate`) and return its token
        stream: `async for token in await conversation.generate(16)`."""
        limit = (await self.session.client.model_info()).limits.max_generate_tokens
        fields = _convert.generate_fields(max_tokens=max_tokens, max_generate_tokens=limit, **sampling)
        async with self._lock:
            await self._settle()
            generation = self._begin(fields)
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
                self._outbox.put_nowait(None)
                async with asyncio.timeout(self._reply_timeout_s):
                    reply = await self._call.read()
                if reply is not grpc.aio.EOF:
                    raise ProtocolError(f"unexpected event after the last command: {reply}")
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        except TimeoutError:
            raise DeadlineExceeded(f"the server did not end the stream within {self._reply_timeout_s} s") from None
        finally:
            self._stop_call()

    # -- used by AsyncConverseTokenStream ----------------------------------------------------------------------
    async def next_token(self, generation: ConverseGeneration) -> int | None:
        """The generation's next token, or None once it has ended."""
        async with self._lock:
            while not generation.finished:
                reply = await self._read(generation.command_id, self._token_timeout_s, InterTokenTimeout)
                if (token := self._feed(generation, reply)) is not None:
                    return token
        return None

    async def stop(self, generation: ConverseGeneration, *, wait: bool) -> None:
        """Cancel `generation`; with `wait`, read its remaining events now, else at the next command."""
        if self._stopping(generation) and wait:
            async with self._lock:
                await self._settle()

    # -- internals ---------------------------------------------------------------------------------------------
    async def _requests(self) -> AsyncIterator[pb.ConverseRequest]:
        while (request := await self._queue.get()) is not None:
            yield request

    async def _command(self, expected: str, **command: Any) -> Any:
        async with self._lock:
            await self._settle()
            reply = await self._read(self._send(**command), self._reply_timeout_s)
        return self._expect(reply, expected)

    async def _settle(self) -> None:
        """Cancel and drain the unfinished generation (caller holds the lock)."""
        generation = self._cancel_unfinished()
        while generation is not None and not generation.finished:
            self._feed(generation, await self._read(generation.command_id, self._reply_timeout_s))

    async def _read(
        self, command_id: int, timeout_s: float | None, on_timeout: type[DeadlineExceeded] = DeadlineExceeded
    ) -> Any:
        if self._failure is not None:
            raise self._ended()
        try:
            async with asyncio.timeout(timeout_s):
                reply = await self._call.read()
        except TimeoutError:
            raise self._stalled(timeout_s, on_timeout) from None
        except asyncio.CancelledError:
            self._fail(KakeyaError("the task reading the conversation was cancelled"))
            raise
        except grpc.RpcError as error:
            raise self._fail(from_rpc_error(error)) from None
        if reply is grpc.aio.EOF:
            raise self._cut_off()
        return self._checked(reply, command_id)


class AsyncConverseTokenStream(ConverseStreamCore[AsyncConversation], AsyncIterator[int]):
    """The token ids of one generate command (see `kakeya.ConverseTokenStream`)."""

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
