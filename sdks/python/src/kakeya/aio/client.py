"""The asyncio client: `AsyncClient`, `AsyncSession` and the `AsyncTokenStream` of one generation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from types import TracebackType
from typing import Any, TypeVar, Unpack

import grpc

from kakeya import _calls, _channel
from kakeya._core import ClientCore, SessionCore
from kakeya._stream import GenerationStream
from kakeya.aio.conversation import AsyncConversation
from kakeya.errors import Cancelled, Unavailable, from_rpc_error
from kakeya.types import ModelInfo, SessionInfo, SessionSettings

R = TypeVar("R")


class AsyncClient(ClientCore[grpc.aio.Channel, "AsyncSession"]):
    """A grpc.aio connection to a Kakeya runtime; the asyncio twin of `kakeya.Client` (same settings).

    One client serves any number of sessions and concurrent tasks. Use it as an async context manager, or
    `await close()`.
    """

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; streams still open on it are cancelled."""
        await self._channel.close()

    async def wait_until_ready(self, timeout_s: float) -> None:
        """Wait until the channel is connected; raises `Unavailable` after `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._channel.channel_ready()
        except TimeoutError:
            raise Unavailable(f"no connection to {self.address} within {timeout_s} s") from None

    async def model_info(self) -> ModelInfo:
        """The served model's facts and the server's defaults and limits (see `Client.model_info`)."""
        if self._model_info is None:
            self._model_info = await self.unary(_calls.model_info())
        return self._model_info

    @property
    def known_model_info(self) -> ModelInfo | None:
        """What `model_info()` returned, once it has been asked (creating a session asks it)."""
        return self._model_info

    async def create_session(
        self, *, routing_key: str | None = None, **settings: Unpack[SessionSettings]
    ) -> AsyncSession:
        """Create a session (arguments as in `Client.create_session`)."""
        call = _calls.create_session(settings)
        await self.model_info()  # the limits generate() checks max_tokens against
        key = _channel.routing_key(routing_key)
        session_id = await self.unary(call, metadata=_channel.routed(self.metadata, key))
        return AsyncSession(self, session_id, routing_key=key)

    async def unary(self, call: _calls.Unary[R], *, metadata: _channel.Metadata | None = None) -> R:
        """Make one unary call (see `Client.unary`)."""
        rpc = getattr(self.stub, call.method)
        attempts = _channel.Attempts(call.method, call.idempotent, self.retry, self.timeout_s)
        metadata = self.metadata if metadata is None else metadata
        while True:
            try:
                reply = await rpc(call.request, timeout=attempts.remaining_s(), metadata=metadata)
            except grpc.RpcError as error:
                await asyncio.sleep(attempts.backoff_s(error))  # raises the error when no attempt is left
            else:
                return call.result(reply)

    def _connect(
        self, address: str, creds: grpc.ChannelCredentials | None, options: list[tuple[str, Any]]
    ) -> grpc.aio.Channel:
        if creds is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, creds, options=options)

    def _handle(self, session_id: str, routing_key: str) -> AsyncSession:
        return AsyncSession(self, session_id, routing_key=routing_key)


class AsyncSession(SessionCore[AsyncClient, "AsyncTokenStream", AsyncConversation]):
    """One server-side session (see `kakeya.Session`); close it with `await close()` or `async with`."""

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._final_history_length is not None:
            return
        if exc is None:
            await self.close()
            return
        try:
            await self.close()
        except Exception as close_error:  # the error already propagating is the one to report
            exc.add_note(f"closing {self!r} also failed: {close_error}")

    async def append(self, token_ids: Iterable[int]) -> int:
        """Append tokens to the history; returns the history length. Never retried."""
        return await self.client.unary(_calls.append_tokens(self.id, token_ids), metadata=self.metadata)

    async def fork(self, *, prefix_tokens: int | None = None, label: str | None = None) -> AsyncSession:
        """Branch the session (see `Session.fork`)."""
        call = _calls.fork_session(self.id, prefix_tokens, label)
        fork_id = await self.client.unary(call, metadata=self.metadata)
        return AsyncSession(self.client, fork_id, routing_key=self.routing_key)

    async def info(self, *, history_tail_tokens: int = 0) -> SessionInfo:
        """Describe the session (see `Session.info`)."""
        return await self.client.unary(_calls.session_info(self.id, history_tail_tokens), metadata=self.metadata)

    async def close(self) -> int:
        """Close the session and free its memory; returns the final history length. Idempotent: closing again
        returns the same length without a call."""
        if self._final_history_length is None:
            call = _calls.close_session(self.id)
            self._final_history_length = await self.client.unary(call, metadata=self.metadata)
        return self._final_history_length

    def _max_generate_tokens(self) -> int | None:
        known = self.client.known_model_info
        return known.limits.max_generate_tokens if known is not None else None

    def _stream(self, call: Any, inter_token_timeout_s: float | None) -> AsyncTokenStream:
        return AsyncTokenStream(self, call, inter_token_timeout_s)

    def _conversation(self, inter_token_timeout_s: float | None) -> AsyncConversation:
        return AsyncConversation(self, inter_token_timeout_s=inter_token_timeout_s)


def task_is_cancelling() -> bool:
    """Whether the running task itself is being cancelled (as opposed to a call cancelled under it)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class AsyncTokenStream(GenerationStream[AsyncSession], AsyncIterator[int]):
    """The token ids of one `Generate` call (see `kakeya.TokenStream`).

    A `cancel()` from another task makes a waiting reader raise `Cancelled`.
    """

    def __init__(self, session: AsyncSession, call: Any, inter_token_timeout_s: float | None) -> None:
        super().__init__(session, call, inter_token_timeout_s)
        self._cancel_requested = False

    def __aiter__(self) -> AsyncTokenStream:
        return self

    async def __anext__(self) -> int:
        while not self._finished:
            try:
                async with asyncio.timeout(self._timeout_s):
                    reply = await self._call.read()
            except TimeoutError:
                self.cancel()
                raise self._timed_out() from None
            except asyncio.CancelledError:
                by_client = self._cancel_requested and not task_is_cancelling()
                self.cancel()
                if by_client:
                    raise Cancelled("the generation was cancelled by the client") from None
                raise
            except grpc.RpcError as error:
                self._finish(self._tally.abandoned())
                raise from_rpc_error(error) from None
            if reply is grpc.aio.EOF:
                raise self._cut_off()
            if (token := self._accept(reply)) is not None:
                return token
        raise StopAsyncIteration

    def cancel(self) -> None:
        """Cancel the generation on the server (no-op once the stream has ended)."""
        self._cancel_requested = True
        super().cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncTokenStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()
