"""Typed service errors. Each carries the wire status it maps to; the transports convert them in one place."""

from __future__ import annotations

from enum import Enum


class Status(Enum):
    """Status codes of the service, named as in gRPC."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    UNAVAILABLE = "UNAVAILABLE"


class ServiceError(Exception):
    """An error returned to the client with a status and a message."""

    status: Status = Status.FAILED_PRECONDITION

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServiceError):
    """Malformed input: token id outside the vocabulary, empty session id, out-of-range parameter."""

    status = Status.INVALID_ARGUMENT


class SessionNotFound(ServiceError):
    """The session id is unknown, closed or evicted."""

    status = Status.NOT_FOUND


class SessionFailed(ServiceError):
    """A cache invariant broke; the session was failed and freed."""

    status = Status.FAILED_PRECONDITION


class ResourceExhausted(ServiceError):
    """A limit was reached: sessions, history length, KV budget, queue deadline."""

    status = Status.RESOURCE_EXHAUSTED


class ShuttingDown(ServiceError):
    """The server is draining and accepts no new work."""

    status = Status.UNAVAILABLE


class JournalUnavailable(ServiceError):
    """The session journal could not record a change, so the change was not made (or its session was failed)."""

    status = Status.UNAVAILABLE
