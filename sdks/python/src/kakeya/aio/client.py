"""The asyncio client: `AsyncClient`, `AsyncSession` and the `AsyncTokenStream` of one generation."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc

from kakeya import _channel, _convert
from kakeya._generated import runtime_pb2 as pb
from kakeya._generated.runtime_pb2_grpc import RuntimeServiceStub
from kakeya._stream import Tally
from kakeya.aio.conversation import AsyncConversation
from kakeya.errors import (
    Cancelled,
    InterTokenTimeout,
    InvalidArgument,
    ProtocolError,
    Unavailable,
    from_rpc_error,
)
from kakeya.types import (
    GenerationControls,
    GenerationStats,
    KvCompressor,
    KvStrategy,
    ModelInfo,
    RetryPolicy,
    SessionInfo,
    TlsConfig,
    TokenLogprobs,
)

R = TypeVar("R")


class AsyncClient:
    """A grpc.aio connection to a Kakeya runtime; the asyncio twin of `kakeya.Client` (same settings).

    One client serves any number of sessions and concurrent tasks. Use it as an async context manager, or
    `await close()`.
    """

    def __init__(
        self,
        address: str = _channel.DEFAULT_ADDRESS,
        *,
        api_key: str | None = None,
        tls: TlsConfig | bool | None = None,
        timeout_s: float | None = 30.0,
        retry: RetryPolicy | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        _channel.check_settings(address, api_key, timeout_s)
        self.address = address
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        creds, tls_options = _channel.credentials(tls)
        options = _channel.channel_options(self.retry, [*tls_options, *channel_options])
        if creds is None:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self._channel = grpc.aio.secure_channel(address, creds, options=options)
        self.stub = RuntimeServiceStub(self._channel)
        self.metadata = _channel.metadata(api_key)
        self._model_info: ModelInfo | None = None

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
            request = pb.GetModelInfoRequest()
            reply = await self.unary(self.stub.GetModelInfo, "GetModelInfo", request, idempotent=True)
            self._model_info = _convert.model_info(reply)
        return self._model_info

    @property
    def known_model_info(self) -> ModelInfo | None:
        """What `model_info()` returned, once it has been asked (creating a session asks it)."""
        return self._model_info

    async def create_session(
        self,
        *,
        initial_tokens: Iterable[int] = (),
        eos_token_ids: Iterable[int] | None = None,
        label: str = "",
        kv_strategy: KvStrategy | str | None = None,
        sink_tokens: int | None = None,
        window_tokens: int | None = None,
        kv_compressor: KvCompressor | str | None = None,
        kv_q_range: int | None = None,
        routing_key: str | None = None,
    ) -> AsyncSession:
        """Create a session (arguments as in `Client.create_session`)."""
        request = _convert.create_request(
            label=label,
            eos_token_ids=eos_token_ids,
            initial_tokens=initial_tokens,
            kv_strategy=kv_strategy,
            sink_tokens=sink_tokens,
            window_tokens=window_tokens,
            kv_compressor=kv_compressor,
            kv_q_range=kv_q_range,
        )
        await self.model_info()  # the limits generate() checks max_tokens against
        key = _channel.routing_key(routing_key)
        reply = await self.unary(
            self.stub.CreateSession,
            "CreateSession",
            request,
            idempotent=False,
            metadata=_channel.routed(self.metadata, key),
        )
        return AsyncSession(self, reply.session_id, routing_key=key)

    def session(self, session_id: str, *, routing_key: str | None = None) -> AsyncSession:
        """A handle on an existing session (no call is made); `routing_key` as in `Client.session`."""
        if not isinstance(session_id, str) or not session_id:
            raise InvalidArgument(f"session_id must be a non-empty string, got {session_id!r}")
        return AsyncSession(self, session_id, routing_key=_channel.routing_key(routing_key, default=session_id))

    async def unary(
        self,
        rpc: Callable[..., Awaitable[R]],
        name: str,
        request: object,
        *,
        idempotent: bool,
        metadata: _channel.Metadata | None = None,
    ) -> R:
        """Run one unary call within the client's deadline, retrying idempotent ones on UNAVAILABLE."""
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        attempt = 1
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await rpc(request, timeout=remaining, metadata=self.metadata if metadata is None else metadata)
            except grpc.RpcError as error:
                if _channel.should_retry(error, idempotent, attempt, self.retry):
                    delay = self.retry.backoff_s(attempt)
                    if deadline is None or time.monotonic() + delay < deadline:
                        _channel.log_retry(name, attempt, self.retry, delay, error)
                        await asyncio.sleep(delay)
                        attempt += 1
                        continue
                raise from_rpc_error(error) from None


class AsyncSession:
    """One server-side session (see `kakeya.Session`); close it with `await close()` or `async with`."""

    def __init__(self, client: AsyncClient, session_id: str, *, routing_key: str | None = None) -> None:
        self.client = client
        self.id = session_id
        self.routing_key = session_id if routing_key is None else routing_key
        """The key a proxy in front of several daemons routes this session's calls by (`x-kakeya-routing-key`)."""
        self.metadata = _channel.routed(client.metadata, self.routing_key)
        self.last_generation: GenerationStats | None = None
        """Statistics of the latest generation started through this handle, once it has ended."""
        self._closed = False
        self._final_history_length: int | None = None

    def __repr__(self) -> str:
        return f"AsyncSession({self.id!r})"

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._closed:
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
        request = pb.AppendTokensRequest(session_id=self.id, token_ids=_convert.token_ids(token_ids, "token_ids"))
        reply = await self.client.unary(
            self.client.stub.AppendTokens, "AppendTokens", request, idempotent=False, metadata=self.metadata
        )
        return int(reply.history_length)

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
        inter_token_timeout_s: float | None = None,
        timeout_s: float | None = None,
    ) -> AsyncTokenStream:
        """Start a generation and return its token ids as an async iterator (parameters as in
        `Session.generate`). Stopping early (`break`, `aclose()`, leaving an `async with` block, or cancelling the
        reading task) cancels it on the server. `max_tokens` is checked against the server's limit once the client
        knows it (`AsyncClient.model_info()`, asked when a session is created). Never retried."""
        known = self.client.known_model_info
        fields = _convert.generate_fields(
            max_tokens=max_tokens,
            seed=seed,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=stop_token_ids,
            max_generate_tokens=known.limits.max_generate_tokens if known is not None else None,
            controls=controls,
        )
        _convert.check_timeout(inter_token_timeout_s, "inter_token_timeout_s")
        _convert.check_timeout(timeout_s, "timeout_s")
        request = pb.GenerateRequest(session_id=self.id, **fields)  # type: ignore[arg-type]
        self.last_generation = None
        call = self.client.stub.Generate(request, timeout=timeout_s, metadata=self.metadata)
        return AsyncTokenStream(self, call, inter_token_timeout_s)

    def converse(self, *, inter_token_timeout_s: float | None = None) -> AsyncConversation:
        """A `Converse` stream bound to this session; open it with `async with` (or `await open()`)."""
        _convert.check_timeout(inter_token_timeout_s, "inter_token_timeout_s")
        return AsyncConversation(self, inter_token_timeout_s=inter_token_timeout_s)

    async def fork(self, *, prefix_tokens: int | None = None, label: str | None = None) -> AsyncSession:
        """Branch the session (see `Session.fork`)."""
        request = _convert.fork_request(self.id, prefix_tokens, label)
        reply = await self.client.unary(
            self.client.stub.ForkSession, "ForkSession", request, idempotent=False, metadata=self.metadata
        )
        return AsyncSession(self.client, reply.session_id, routing_key=self.routing_key)

    async def info(self, *, history_tail_tokens: int = 0) -> SessionInfo:
        """Describe the session (see `Session.info`)."""
        request = pb.GetSessionInfoRequest(
            session_id=self.id, history_tail_tokens=_convert.uint32(history_tail_tokens, "history_tail_tokens")
        )
        reply = await self.client.unary(
            self.client.stub.GetSessionInfo, "GetSessionInfo", request, idempotent=True, metadata=self.metadata
        )
        return _convert.session_info(reply)

    async def close(self) -> int:
        """Close the session and free its memory; returns the final history length. Idempotent: closing again
        returns the same length without a call."""
        if self._final_history_length is not None:
            return self._final_history_length
        request = pb.CloseSessionRequest(session_id=self.id)
        reply = await self.client.unary(
            self.client.stub.CloseSession, "CloseSession", request, idempotent=True, metadata=self.metadata
        )
        self._closed = True
        self._final_history_length = int(reply.final_history_length)
        return self._final_history_length


def task_is_cancelling() -> bool:
    """Whether the running task itself is being cancelled (as opposed to a call cancelled under it)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class AsyncTokenStream(AsyncIterator[int]):
    """The token ids of one `Generate` call (see `kakeya.TokenStream`).

    A `cancel()` from another task makes a waiting reader raise `Cancelled`.
    """

    def __init__(self, session: AsyncSession, call: Any, inter_token_timeout_s: float | None) -> None:
        self.session = session
        self._call = call
        self._tally = Tally()
        self._finished = False
        self._cancel_requested = False
        self._stats: GenerationStats | None = None
        self._timeout_s = inter_token_timeout_s

    @property
    def tokens(self) -> list[int]:
        return list(self._tally.tokens)

    @property
    def logprobs(self) -> list[TokenLogprobs]:
        """Log-probabilities of the tokens received so far (one per token; empty unless the generation asked for
        them with `GenerationControls(logprobs=True)`)."""
        return list(self._tally.logprobs)

    @property
    def stats(self) -> GenerationStats | None:
        return self._stats

    @property
    def truncated_token_count(self) -> int:
        return self._tally.truncated_token_count

    def __aiter__(self) -> AsyncTokenStream:
        return self

    async def __anext__(self) -> int:
        while not self._finished:
            try:
                async with asyncio.timeout(self._timeout_s):
                    reply = await self._call.read()
            except TimeoutError:
                self.cancel()
                raise InterTokenTimeout(
                    f"no event within inter_token_timeout_s={self._timeout_s} on session {self.session.id!r}; "
                    "the generation was cancelled"
                ) from None
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
                self._finish(None)
                raise ProtocolError("the Generate stream ended without its final message")
            token = self._tally.feed(reply.WhichOneof("payload"), reply)
            if token is not None:
                return token
            if self._tally.stats is not None:
                self._finish(self._tally.stats)
        raise StopAsyncIteration

    def cancel(self) -> None:
        """Cancel the generation on the server (no-op once the stream has ended)."""
        self._cancel_requested = True
        if not self._finished:
            self._finish(self._tally.abandoned())
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncTokenStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        if not getattr(self, "_finished", True):
            with contextlib.suppress(Exception):  # the event loop is already closed
                self.cancel()

    def _finish(self, stats: GenerationStats | None) -> None:
        self._finished = True
        self._stats = stats
        self.session.last_generation = stats
