"""Channel construction shared by the sync and asyncio clients: credentials, options, call metadata."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from typing import Any

import grpc

from kakeya.errors import InvalidArgument
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


def should_retry(error: grpc.RpcError, idempotent: bool, attempt: int, retry: RetryPolicy) -> bool:
    return idempotent and error.code() == grpc.StatusCode.UNAVAILABLE and attempt < retry.max_attempts


def log_retry(method: str, attempt: int, retry: RetryPolicy, delay_s: float, error: grpc.RpcError) -> None:
    log.info(
        "retrying %s after UNAVAILABLE (attempt %d of %d failed; next in %.2f s): %s",
        method,
        attempt,
        retry.max_attempts,
        delay_s,
        error.details(),
    )
