"""Channel construction shared by the sync and asyncio clients: credentials, options, call metadata."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from typing import Any

import grpc

from kakeya.errors import InvalidArgument, from_rpc_error
from kakeya.types import RetryPolicy, TlsConfig

log = logging.getLogger("kakeya")

MAX_MESSAGE_BYTES = 64 << 20
DEFAULT_ADDRESS = "127.0.0.1:50051"

Metadata = tuple[tuple[str, str], ...]

ROUTING_KEY_HEADER = "x-kakeya-routing-key"
"""The metadata key every call of a session carries its routing key in; a proxy in front of several daemons
hashes on it so that all calls of a session reach the daemon holding its KV cache (docs/scale-out.md)."""


def check_settings(address: str, api_key: str | None, timeout_s: float | None) -> None:
    if not isinstance(address, str) or not address:
        raise InvalidArgument(f"address must be a non-empty 'host:port' string, got {address!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise InvalidArgument("api_key must be a non-empty string or None")
    if timeout_s is not None and not timeout_s > 0:
        raise InvalidArgument(f"timeout_s must be > 0 or None, got {timeout_s}")


def channel_options(retry: RetryPolicy, extra: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Options that let a channel reconnect within the retry policy's backoff (gRPC's defaults wait up to 2 min)."""
    backoff_ms = max(1, int(retry.initial_backoff_s * 1000))
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.initial_reconnect_backoff_ms", backoff_ms),
        ("grpc.min_reconnect_backoff_ms", backoff_ms),
        ("grpc.max_reconnect_backoff_ms", max(backoff_ms, int(retry.max_backoff_s * 1000))),
    ]
    return options + list(extra)


def credentials(tls: TlsConfig | bool | None) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
    """(channel credentials or None for plaintext, extra channel options)."""
    if tls is None or tls is False:
        return None, []
    config = TlsConfig() if tls is True else tls
    if not isinstance(config, TlsConfig):
        raise InvalidArgument(f"tls must be a TlsConfig, True, False or None, got {tls!r}")
    creds = grpc.ssl_channel_credentials(
        root_certificates=config.root_certificates,
        private_key=config.private_key,
        certificate_chain=config.certificate_chain,
    )
    options = [("grpc.ssl_target_name_override", config.server_name)] if config.server_name else []
    return creds, options


def metadata(api_key: str | None) -> Metadata:
    """Per-call metadata: the API key as a bearer token (sent on plaintext loopback channels too)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def routing_key(key: str | None, default: str | None = None) -> str:
    """`key` checked, or `default`, or a fresh random key (128 bits)."""
    if key is None:
        return default if default is not None else secrets.token_urlsafe(16)
    if not isinstance(key, str) or not key or not key.isprintable() or not key.isascii():
        raise InvalidArgument(f"routing_key must be a non-empty printable ASCII string, got {key!r}")
    return key


def routed(metadata: Metadata, key: str) -> Metadata:
    """Call metadata carrying a session's routing key."""
    return (*metadata, (ROUTING_KEY_HEADER, key))


class Attempts:
    """The attempts of one unary call: the time left before its deadline and, after a failure, whether and when to
    try again (an idempotent call on UNAVAILABLE, within the retry policy and the deadline)."""

    def __init__(self, method: str, idempotent: bool, retry: RetryPolicy, timeout_s: float | None) -> None:
        self._method = method
        self._idempotent = idempotent
        self._retry = retry
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._attempt = 1

    def remaining_s(self) -> float | None:
        """The timeout of the next attempt: what is left of the deadline (None: no deadline)."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def backoff_s(self, error: grpc.RpcError) -> float:
        """How long to wait before the next attempt; raises `error` as a `KakeyaError` when there is none."""
        retry = self._retry
        if self._idempotent and error.code() == grpc.StatusCode.UNAVAILABLE and self._attempt < retry.max_attempts:
            delay = retry.backoff_s(self._attempt)
            if self._deadline is None or time.monotonic() + delay < self._deadline:
                log.info(
                    "retrying %s after UNAVAILABLE (attempt %d of %d failed; next in %.2f s): %s",
                    self._method,
                    self._attempt,
                    retry.max_attempts,
                    delay,
                    error.details(),
                )
                self._attempt += 1
                return delay
        raise from_rpc_error(error) from None
