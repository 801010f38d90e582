"""The synchronous client: `Client`, `Session` and the `TokenStream` of one generation."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc

from kakeya import _channel, _convert
from kakeya._generated import runtime_pb2 as pb
from kakeya._generated.runtime_pb2_grpc import RuntimeServiceStub
from kakeya._stream import Tally, Watchdog
from kakeya.conversation import Conversation
from kakeya.errors import InterTokenTimeout, InvalidArgument, ProtocolError, Unavailable, from_rpc_error
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


class Client:
    """A connection to a Kakeya runtime.

    `timeout_s` is the deadline of each unary call (create, append, info, close), retries included; generations
    have their own `timeout_s` and `inter_token_timeout_s`. `info` and `close` are retried on UNAVAILABLE as
    `retry` says; nothing else is. Use it as a context manager, or call `close()`.
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
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            self._channel = grpc.secure_channel(address, creds, options=options)
        self.stub = RuntimeServiceStub(self._channel)
        self.metadata = _channel.metadata(api_key)
        self._model_info: ModelInfo | None = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel; streams still open on it are cancelled."""
        self._channel.close()

    def wait_until_ready(self, timeout_s: float) -> None:
        """Block until the channel is connected; raises `Unavailable` after `timeout_s`."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"no connection to {self.address} within {timeout_s} s") from None

    def model_info(self) -> ModelInfo:
        """The served model's facts (vocabulary size, EOS ids, trained context length, chat template) and the
        server's defaults and limits. Asked once per client, then remembered."""
        if self._model_info is None:
            reply = self.unary(self.stub.GetModelInfo, "GetModelInfo", pb.GetModelInfoRequest(), idempotent=True)
            self._model_info = _convert.model_info(reply)
        return self._model_info

    def create_session(
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
    ) -> Session:
        """Create a session, optionally starting with `initial_tokens` (pending until the first generation).

        `eos_token_ids` end every generation of the session with stop reason EOS; None (the default) takes the
        model's end-of-sequence ids (`model_info().eos_token_ids`), an empty list gives none. `kv_strategy`,
        `sink_tokens` and `window_tokens` override the server's defaults for this session, as do `kv_compressor`
        (none, kakeya_d4, kakeya_e8: how committed K/V are held) and `kv_q_range` (its lattice range Q).
        `routing_key` is sent with every call of the session (`x-kakeya-routing-key` metadata) so that a proxy in
        front of several daemons sends them all to one daemon; None picks a random one. Sessions given the same
        key land on the same daemon (docs/scale-out.md).
        """
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
        key = _channel.routing_key(routing_key)
        reply = self.unary(
            self.stub.CreateSession,
            "CreateSession",
            request,
            idempotent=False,
            metadata=_channel.routed(self.metadata, key),
        )
        return Session(self, reply.session_id, routing_key=key)

    def session(self, session_id: str, *, routing_key: str | None = None) -> Session:
        """A handle on an existing session (no call is made). Behind a proxy, pass the session's `routing_key`
        (`Session.routing_key`) to keep its calls on the daemon that holds it; without one the session id is the
        key, and the daemon that key reaches takes the session over from the shared journal on the first call."""
        if not isinstance(session_id, str) or not session_id:
            raise InvalidArgument(f"session_id must be a non-empty string, got {session_id!r}")
        return Session(self, session_id, routing_key=_channel.routing_key(routing_key, default=session_id))

    def unary(
        self,
        rpc: Callable[..., R],
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
                return rpc(request, timeout=remaining, metadata=self.metadata if metadata is None else metadata)
            except grpc.RpcError as error:
                if _channel.should_retry(error, idempotent, attempt, self.retry):
                    delay = self.retry.backoff_s(attempt)
                    if deadline is None or time.monotonic() + delay < deadline:
                        _channel.log_retry(name, attempt, self.retry, delay, error)
                        time.sleep(delay)
                        attempt += 1
                        continue
                raise from_rpc_error(error) from None


class Session:
    """One server-side session: an append-only token history and its KV cache.

    Closing it (`close()`, or leaving a `with` block) frees the server's memory.
    """

    def __init__(self, client: Client, session_id: str, *, routing_key: str | None = None) -> None:
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
        return f"Session({self.id!r})"

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._closed:
            return
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_error:  # the error already propagating is the one to report
            exc.add_note(f"closing {self!r} also failed: {close_error}")

    def append(self, token_ids: Iterable[int]) -> int:
        """Append tokens to the history; returns the history length. Never retried."""
        request = pb.AppendTokensRequest(session_id=self.id, token_ids=_convert.token_ids(token_ids, "token_ids"))
        reply = self.client.unary(
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
    ) -> TokenStream:
        """Start a generation and return its token ids as an iterator.

        Unset `temperature` (or 0) is greedy decoding; `seed` makes sampling reproducible. `stop_token_ids` end this
        generation with stop reason EOS (the stop token is streamed). `inter_token_timeout_s` bounds every wait for
        the next event, the first token included (`InterTokenTimeout`); `timeout_s` bounds the whole generation
        (`DeadlineExceeded`). Stopping early (break, `close()`, leaving a `with` block) cancels it on the server.
        Never retried.
        """
        fields = _convert.generate_fields(
            max_tokens=max_tokens,
            seed=seed,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=stop_token_ids,
            max_generate_tokens=self.client.model_info().limits.max_generate_tokens,
            controls=controls,
        )
        _convert.check_timeout(inter_token_timeout_s, "inter_token_timeout_s")
        _convert.check_timeout(timeout_s, "timeout_s")
        request = pb.GenerateRequest(session_id=self.id, **fields)  # type: ignore[arg-type]
        self.last_generation = None
        call = self.client.stub.Generate(request, timeout=timeout_s, metadata=self.metadata)
        return TokenStream(self, call, inter_token_timeout_s)

    def converse(self, *, inter_token_timeout_s: float | None = None) -> Conversation:
        """Open a `Converse` stream bound to this session (see `Conversation`)."""
        _convert.check_timeout(inter_token_timeout_s, "inter_token_timeout_s")
        return Conversation(self, inter_token_timeout_s=inter_token_timeout_s)

    def fork(self, *, prefix_tokens: int | None = None, label: str | None = None) -> Session:
        """Branch the session: a new session whose history is this one's (its first `prefix_tokens` tokens when
        given) and whose KV cache starts as a copy of this one's, so the branch costs no prefill. `label` defaults
        to this session's. The two are independent afterwards; a fork of a generating session waits for the
        generation to end. Never retried (a retry could create a second fork)."""
        request = _convert.fork_request(self.id, prefix_tokens, label)
        reply = self.client.unary(
            self.client.stub.ForkSession, "ForkSession", request, idempotent=False, metadata=self.metadata
        )
        return Session(self.client, reply.session_id, routing_key=self.routing_key)

    def info(self, *, history_tail_tokens: int = 0) -> SessionInfo:
        """Describe the session; `history_tail_tokens` > 0 also returns that many trailing history tokens
        (a client that stopped reading a stream early learns from it which tokens entered the history)."""
        request = pb.GetSessionInfoRequest(
            session_id=self.id, history_tail_tokens=_convert.uint32(history_tail_tokens, "history_tail_tokens")
        )
        reply = self.client.unary(
            self.client.stub.GetSessionInfo, "GetSessionInfo", request, idempotent=True, metadata=self.metadata
        )
        return _convert.session_info(reply)

    def close(self) -> int:
        """Close the session and free its memory on the server; returns the final history length. A running
        generation on it ends with stop reason CANCELLED. Idempotent: closing again returns the same length
        without a call."""
        if self._final_history_length is not None:
            return self._final_history_length
        request = pb.CloseSessionRequest(session_id=self.id)
        reply = self.client.unary(
            self.client.stub.CloseSession, "CloseSession", request, idempotent=True, metadata=self.metadata
        )
        self._closed = True
        self._final_history_length = int(reply.final_history_length)
        return self._final_history_length


class TokenStream(Iterator[int]):
    """The token ids of one `Generate` call, in order, as they arrive.

    After the stream ends, `stats` holds the server's statistics (also in `Session.last_generation`). Stopping
    early cancels the call: breaking out of a `for` loop over the stream does (the stream is dropped), and so do
    `close()` and leaving a `with` block; a `cancel()` from another thread makes a blocked reader raise `Cancelled`.
    """

    def __init__(self, session: Session, call: Any, inter_token_timeout_s: float | None) -> None:
        self.session = session
        self._call = call
        self._tally = Tally()
        self._finished = False
        self._stats: GenerationStats | None = None
        self._timeout_s = inter_token_timeout_s
        self._watchdog: Watchdog | None = None
        if inter_token_timeout_s is not None:
            self._watchdog = Watchdog(call.cancel)
            self._watchdog.arm(inter_token_timeout_s)

    @property
    def tokens(self) -> list[int]:
        """Tokens received so far."""
        return list(self._tally.tokens)

    @property
    def logprobs(self) -> list[TokenLogprobs]:
        """Log-probabilities of the tokens received so far (one per token; empty unless the generation asked for
        them with `GenerationControls(logprobs=True)`)."""
        return list(self._tally.logprobs)

    @property
    def stats(self) -> GenerationStats | None:
        """The generation's statistics once it has ended (see `GenerationStats.server_reported`)."""
        return self._stats

    @property
    def truncated_token_count(self) -> int:
        """History positions no longer resident when the generation started (0 when none were evicted)."""
        return self._tally.truncated_token_count

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> int:
        while not self._finished:
            try:
                reply = next(self._call)
            except StopIteration:
                self._finish(None)
                raise ProtocolError("the Generate stream ended without its final message") from None
            except grpc.RpcError as error:
                expired = self._watchdog is not None and self._watchdog.expired
                self._finish(self._tally.abandoned())
                if expired:
                    raise InterTokenTimeout(
                        f"no event within inter_token_timeout_s={self._timeout_s} on session {self.session.id!r}; "
                        "the generation was cancelled"
                    ) from None
                raise from_rpc_error(error) from None
            if self._watchdog is not None:
                self._watchdog.arm(self._timeout_s)
            token = self._tally.feed(reply.WhichOneof("payload"), reply)
            if token is not None:
                return token
            if self._tally.stats is not None:
                self._finish(self._tally.stats)
        raise StopIteration

    def cancel(self) -> None:
        """Cancel the generation on the server (no-op once the stream has ended)."""
        if not self._finished:
            self._finish(self._tally.abandoned())
            self._call.cancel()

    close = cancel

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        if not getattr(self, "_finished", True):
            with contextlib.suppress(Exception):  # interpreter shutdown: the channel is already gone
                self.cancel()

    def _finish(self, stats: GenerationStats | None) -> None:
        self._finished = True
        if self._watchdog is not None:
            self._watchdog.stop()
        self._stats = stats
        self.session.last_generation = stats
