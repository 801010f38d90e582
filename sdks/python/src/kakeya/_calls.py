"""The unary calls of `kakeya.v1.RuntimeService` as values: the request to send, whether a retry is safe, and how
the reply becomes what the SDK returns. `Client` and `AsyncClient` send the same values and differ only in how they
wait for the reply."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kakeya import _convert
from kakeya._generated import runtime_pb2 as pb
from kakeya.types import ModelInfo, SessionInfo, SessionSettings

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Unary(Generic[R]):
    """One unary call, ready to send."""

    method: str
    """The `RuntimeService` method, as the generated stub names it."""
    request: Any
    idempotent: bool
    """Whether the call is retried on UNAVAILABLE (a lost reply of any other could mean the server acted twice)."""
    result: Callable[[Any], R]
    """What the SDK method returns, made from the reply."""


def model_info() -> Unary[ModelInfo]:
    """Ask for the served model's facts and the server's defaults and limits."""
    return Unary("GetModelInfo", pb.GetModelInfoRequest(), idempotent=True, result=_convert.model_info)


def create_session(settings: SessionSettings) -> Unary[str]:
    """Create a session; the result is its id."""
    request = _convert.create_request(**settings)
    return Unary("CreateSession", request, idempotent=False, result=_session_id)


def append_tokens(session_id: str, token_ids: Iterable[int]) -> Unary[int]:
    """Append tokens; the result is the history length."""
    request = pb.AppendTokensRequest(session_id=session_id, token_ids=_convert.token_ids(token_ids, "token_ids"))
    return Unary("AppendTokens", request, idempotent=False, result=_history_length)


def fork_session(session_id: str, prefix_tokens: int | None, label: str | None) -> Unary[str]:
    """Fork a session (a retry could create a second fork); the result is the fork's id."""
    request = _convert.fork_request(session_id, prefix_tokens, label)
    return Unary("ForkSession", request, idempotent=False, result=_session_id)


def session_info(session_id: str, history_tail_tokens: int) -> Unary[SessionInfo]:
    """Describe a session, with its last `history_tail_tokens` history tokens."""
    tail = _convert.uint32(history_tail_tokens, "history_tail_tokens")
    request = pb.GetSessionInfoRequest(session_id=session_id, history_tail_tokens=tail)
    return Unary("GetSessionInfo", request, idempotent=True, result=_convert.session_info)


def close_session(session_id: str) -> Unary[int]:
    """Close a session; the result is its final history length."""
    request = pb.CloseSessionRequest(session_id=session_id)
    return Unary("CloseSession", request, idempotent=True, result=_final_history_length)


def _session_id(reply: Any) -> str:
    return str(reply.session_id)


def _history_length(reply: Any) -> int:
    return int(reply.history_length)


def _final_history_length(reply: Any) -> int:
    return int(reply.final_history_length)
