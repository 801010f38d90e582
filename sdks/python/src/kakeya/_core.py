"""What the sync and asyncio clients share: a client's settings and channel, a session handle's state, and starting
a generation. `Client`/`Session` and `AsyncClient`/`AsyncSession` add only how a call is made and waited for."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Generic, TypeVar, Unpack

import grpc

from kakeya import _channel, _convert
from kakeya._generated import runtime_pb2 as pb
from kakeya._generated.runtime_pb2_grpc import RuntimeServiceStub
from kakeya.errors import InvalidArgument
from kakeya.types import GenerationStats, ModelInfo, RetryPolicy, SamplingOptions, TlsConfig

ChannelT = TypeVar("ChannelT")
SessionT = TypeVar("SessionT")
ClientT = TypeVar("ClientT", bound="ClientCore[Any, Any]")
StreamT = TypeVar("StreamT")
ConversationT = TypeVar("ConversationT")


class ClientCore(ABC, Generic[ChannelT, SessionT]):
    """The settings, channel and call metadata of a client; its subclasses make the calls."""

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
        self._channel = self._connect(address, creds, options)
        self.stub = RuntimeServiceStub(self._channel)
        self.metadata = _channel.metadata(api_key)
        self._model_info: ModelInfo | None = None

    def session(self, session_id: str, *, routing_key: str | None = None) -> SessionT:
        """A handle on an existing session (no call is made). Behind a proxy, pass the session's `routing_key`
        (`Session.routing_key`) to keep its calls on the daemon that holds it; without one the session id is the
        key, and the daemon that key reaches takes the session over from the shared journal on the first call."""
        if not isinstance(session_id, str) or not session_id:
            raise InvalidArgument(f"session_id must be a non-empty string, got {session_id!r}")
        return self._handle(session_id, _channel.routing_key(routing_key, default=session_id))

    @abstractmethod
    def _connect(self, address: str, creds: grpc.ChannelCredentials | None, options: list[tuple[str, Any]]) -> ChannelT:
        """A channel to `address`, plaintext when `creds` is None."""

    @abstractmethod
    def _handle(self, session_id: str, routing_key: str) -> SessionT:
        """A handle on session `session_id` whose calls carry `routing_key`."""


class SessionCore(ABC, Generic[ClientT, StreamT, ConversationT]):
    """The state of a session handle and the start of a generation; its subclasses make the unary calls."""

    def __init__(self, client: ClientT, session_id: str, *, routing_key: str | None = None) -> None:
        self.client = client
        self.id = session_id
        self.routing_key = session_id if routing_key is None else routing_key
        """The key a proxy in front of several daemons routes this session's calls by (`x-kakeya-routing-key`)."""
        self.metadata = _channel.routed(client.metadata, self.routing_key)
        self.last_generation: GenerationStats | None = None
        """Statistics of the latest generation started through this handle, once it has ended."""
        self._final_history_length: int | None = None  # set once the session is closed

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    def generate(
        self,
        max_tokens: int,
        *,
        inter_token_timeout_s: float | None = None,
        timeout_s: float | None = None,
        **sampling: Unpack[SamplingOptions],
    ) -> StreamT:
        """Start a generation and return its token ids as an iterator (`async for` on `AsyncSession`).

        `sampling` takes the `SamplingOptions`: unset `temperature` (or 0) is greedy decoding, `seed` makes sampling
        reproducible, `top_p` and `top_k` narrow the candidates, `stop_token_ids` end this generation with stop
        reason EOS (the stop token is streamed), `controls` adds a grammar, stop sequences, log-probabilities and
        penalties. `inter_token_timeout_s` bounds every wait for the next event, the first token included
        (`InterTokenTimeout`); `timeout_s` bounds the whole generation (`DeadlineExceeded`). Stopping early (break,
        `close()` or `aclose()`, leaving a `with` or `async with` block, cancelling the reading task) cancels it on
        the server. `max_tokens` is checked against the server's limit; `AsyncSession` knows it once its client has
        asked (`AsyncClient.model_info()`, asked when a session is created). Never retried.
        """
        limit = self._max_generate_tokens()
        fields = _convert.generate_fields(max_tokens=max_tokens, max_generate_tokens=limit, **sampling)
        _convert.check_timeout(inter_token_timeout_s, "inter_token_timeout_s")
        _convert.check_timeout(timeout_s, "timeout_s")
        request = pb.GenerateRequest(session_id=self.id, **fields)  # type: ignore[arg-type]
        self.last_generation = None
        call = self.client.stub.Generate(request, timeout=timeout_s, metadata=self.metadata)
        return self._stream(call, inter_token_timeout_s)

    def converse(self, *, inter_token_timeout_s: float | None = None) -> ConversationT:
        """A `Converse` stream bound to this session (see `Conversation`); the asyncio one opens with `async with`
        (or `await open()`)."""
        _convert.check_timeout(inter_token_timeout_s, "inter_token_timeout_s")
        return self._conversation(inter_token_timeout_s)

    @abstractmethod
    def _max_generate_tokens(self) -> int | None:
        """The server's limit on `max_tokens`, or None while the client does not know it."""

    @abstractmethod
    def _stream(self, call: Any, inter_token_timeout_s: float | None) -> StreamT:
        """The token stream reading the `Generate` call `call`."""

    @abstractmethod
    def _conversation(self, inter_token_timeout_s: float | None) -> ConversationT:
        """A `Converse` stream bound to this session."""
