"""The synchronous client: `Client`, `Session` and the `TokenStream` of one generation."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar, Unpack

import grpc

from kakeya import _calls, _channel
from kakeya._core import ClientCore, SessionCore
from kakeya._stream import GenerationStream, Watchdog
from kakeya.conversation import Conversation
from kakeya.errors import Unavailable, from_rpc_error
from kakeya.types import GenerationStats, ModelInfo, SessionInfo, SessionSettings

R = TypeVar("R")


class Client(ClientCore[grpc.Channel, "Session"]):
    """A connection to a Kakeya runtime.

    `timeout_s` is the deadline of each unary call (create, append, info, close), retries included; generations
    have their own `timeout_s` and `inter_token_timeout_s`. `info` and `close` are retried on UNAVAILABLE as
    `retry` says; nothing else is. Use it as a context manager, or call `close()`.
    """

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
            self._model_info = self.unary(_calls.model_info())
        return self._model_info

    def create_session(self, *, routing_key: str | None = None, **settings: Unpack[SessionSettings]) -> Session:
        """Create a session, optionally starting with `initial_tokens` (pending until the first generation).

        `eos_token_ids` end every generation of the session with stop reason EOS; None (the default) takes the
        model's end-of-sequence ids (`model_info().eos_token_ids`), an empty list gives none. `label` names the
        session. `kv_strategy`, `sink_tokens` and `window_tokens` override the server's defaults for this session,
        as do `kv_compressor` (none, kakeya_d4, kakeya_e8, ...: how committed K/V are held) and `kv_q_range` (its
        lattice range Q); `SessionSettings` lists them all with their types. `routing_key` is sent with every call
        of the session (`x-kakeya-routing-key` metadata) so that a proxy in front of several daemons sends them all
        to one daemon; None picks a random one. Sessions given the same key land on the same daemon
        (docs/scale-out.md).
        """
        call = _calls.create_session(settings)
        key = _channel.routing_key(routing_key)
        session_id = self.unary(call, metadata=_channel.routed(self.metadata, key))
        return Session(self, session_id, routing_key=key)

    def unary(self, call: _calls.Unary[R], *, metadata: _channel.Metadata | None = None) -> R:
        """Make one unary call within the client's deadline, retrying an idempotent one on UNAVAILABLE as `retry`
        says; `metadata` replaces the client's call metadata (a session's carries its routing key)."""
        rpc = getattr(self.stub, call.method)
        attempts = _channel.Attempts(call.method, call.idempotent, self.retry, self.timeout_s)
        metadata = self.metadata if metadata is None else metadata
        while True:
            try:
                reply = rpc(call.request, timeout=attempts.remaining_s(), metadata=metadata)
            except grpc.RpcError as error:
                time.sleep(attempts.backoff_s(error))  # raises the error when no attempt is left
            else:
                return call.result(reply)

    def _connect(
        self, address: str, creds: grpc.ChannelCredentials | None, options: list[tuple[str, Any]]
    ) -> grpc.Channel:
        if creds is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, creds, options=options)

    def _handle(self, session_id: str, routing_key: str) -> Session:
        return Session(self, session_id, routing_key=routing_key)


class Session(SessionCore[Client, "TokenStream", Conversation]):
    """One server-side session: an append-only token history and its KV cache.

    Closing it (`close()`, or leaving a `with` block) frees the server's memory.
    """

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._final_history_length is not None:
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
        return self.client.unary(_calls.append_tokens(self.id, token_ids), metadata=self.metadata)

    def fork(self, *, prefix_tokens: int | None = None, label: str | None = None) -> Session:
        """Branch the session: a new session whose history is this one's (its first `prefix_tokens` tokens when
        given) and whose KV cache starts as a copy of this one's, so the branch costs no prefill. `label` defaults
        to this session's. The two are independent afterwards; a fork of a generating session waits for the
        generation to end. Never retried (a retry could create a second fork)."""
        fork_id = self.client.unary(_calls.fork_session(self.id, prefix_tokens, label), metadata=self.metadata)
        return Session(self.client, fork_id, routing_key=self.routing_key)

    def info(self, *, history_tail_tokens: int = 0) -> SessionInfo:
        """Describe the session; `history_tail_tokens` > 0 also returns that many trailing history tokens
        (a client that stopped reading a stream early learns from it which tokens entered the history)."""
        return self.client.unary(_calls.session_info(self.id, history_tail_tokens), metadata=self.metadata)

    def close(self) -> int:
        """Close the session and free its memory on the server; returns the final history length. A running
        generation on it ends with stop reason CANCELLED. Idempotent: closing again returns the same length
        without a call."""
        if self._final_history_length is None:
            self._final_history_length = self.client.unary(_calls.close_session(self.id), metadata=self.metadata)
        return self._final_history_length

    def _max_generate_tokens(self) -> int:
        return self.client.model_info().limits.max_generate_tokens

    def _stream(self, call: Any, inter_token_timeout_s: float | None) -> TokenStream:
        return TokenStream(self, call, inter_token_timeout_s)

    def _conversation(self, inter_token_timeout_s: float | None) -> Conversation:
        return Conversation(self, inter_token_timeout_s=inter_token_timeout_s)


class TokenStream(GenerationStream[Session], Iterator[int]):
    """The token ids of one `Generate` call, in order, as they arrive.

    After the stream ends, `stats` holds the server's statistics (also in `Session.last_generation`). Stopping
    early cancels the call: breaking out of a `for` loop over the stream does (the stream is dropped), and so do
    `close()` and leaving a `with` block; a `cancel()` from another thread makes a blocked reader raise `Cancelled`.
    """

    def __init__(self, session: Session, call: Any, inter_token_timeout_s: float | None) -> None:
        super().__init__(session, call, inter_token_timeout_s)
        self._watchdog: Watchdog | None = None
        if inter_token_timeout_s is not None:
            self._watchdog = Watchdog(call.cancel)
            self._watchdog.arm(inter_token_timeout_s)

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> int:
        while not self._finished:
            try:
                reply = next(self._call)
            except StopIteration:
                raise self._cut_off() from None
            except grpc.RpcError as error:
                expired = self._watchdog is not None and self._watchdog.expired
                self._finish(self._tally.abandoned())
                raise (self._timed_out() if expired else from_rpc_error(error)) from None
            if self._watchdog is not None:
                self._watchdog.arm(self._timeout_s)
            if (token := self._accept(reply)) is not None:
                return token
        raise StopIteration

    def close(self) -> None:
        """Cancel the generation (as `cancel()`)."""
        self.cancel()

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def _finish(self, stats: GenerationStats | None) -> None:
        super()._finish(stats)
        if self._watchdog is not None:
            self._watchdog.stop()
