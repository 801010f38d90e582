"""Typed errors of the SDK: one class per status the runtime returns, all under `KakeyaError`.

Each error carries the server's message unchanged. Errors raised before a request is sent (a value the wire
cannot carry) use the same classes with `status` None.
"""

from __future__ import annotations

import grpc


class KakeyaError(Exception):
    """Base class of every error the SDK raises. `status` is the gRPC status the call failed with (None when the
    SDK raised it without a call, e.g. a value the wire cannot carry) and `message` the server's (or the SDK's)
    explanation. `status_code` is the status each class stands for."""

    status_code: grpc.StatusCode | None = None

    def __init__(self, message: str, *, status: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    def __str__(self) -> str:
        name = self.status.name if self.status is not None else "CLIENT"
        return f"{name}: {self.message}"


class SessionNotFound(KakeyaError):
    """The session id is unknown, closed, evicted, or failed (NOT_FOUND)."""

    status_code = grpc.StatusCode.NOT_FOUND


class InvalidArgument(KakeyaError, ValueError):
    """Malformed input: a token id outside the vocabulary, an out-of-range parameter (INVALID_ARGUMENT)."""

    status_code = grpc.StatusCode.INVALID_ARGUMENT


class InvariantViolation(KakeyaError):
    """A cache invariant broke on the server; the session was failed and freed (FAILED_PRECONDITION)."""

    status_code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(KakeyaError):
    """A server limit was reached: sessions, history length, append size, KV budget, queue deadline
    (RESOURCE_EXHAUSTED)."""

    status_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(KakeyaError):
    """The API key is missing or wrong (UNAUTHENTICATED)."""

    status_code = grpc.StatusCode.UNAUTHENTICATED


class Cancelled(KakeyaError):
    """The call was cancelled before it completed (CANCELLED)."""

    status_code = grpc.StatusCode.CANCELLED


class Unavailable(KakeyaError):
    """The server cannot be reached or is shutting down (UNAVAILABLE)."""

    status_code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(KakeyaError, TimeoutError):
    """The call's deadline passed before it completed (DEADLINE_EXCEEDED)."""

    status_code = grpc.StatusCode.DEADLINE_EXCEEDED


class InterTokenTimeout(DeadlineExceeded):
    """No event arrived on a token stream within `inter_token_timeout_s`; the stream was cancelled."""


class ProtocolError(KakeyaError):
    """The server's replies broke the protocol (for example, a token stream ended without its final message)."""


_BY_STATUS: dict[grpc.StatusCode, type[KakeyaError]] = {
    cls.status_code: cls
    for cls in (
        SessionNotFound,
        InvalidArgument,
        InvariantViolation,
        ResourceExhausted,
        Unauthenticated,
        Cancelled,
        Unavailable,
        DeadlineExceeded,
    )
    if cls.status_code is not None
}


def from_rpc_error(error: grpc.RpcError) -> KakeyaError:
    """The typed error for a failed call (sync or asyncio); statuses without their own class map to the base."""
    status: grpc.StatusCode = error.code()
    message = error.details() or status.name
    return _BY_STATUS.get(status, KakeyaError)(message, status=status)
