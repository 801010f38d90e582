"""Python client of the Kakeya runtime: sessions of raw token ids over gRPC, sync (`Client`) and asyncio
(`AsyncClient`).

    with kakeya.Client("127.0.0.1:50051") as client, client.create_session(initial_tokens=ids) as session:
        for token in session.generate(max_tokens=64):
            ...

Chat-template helpers live in `kakeya.tokenization` (install the `tokenization` extra).
"""

from kakeya.aio import AsyncClient, AsyncConversation, AsyncConverseTokenStream, AsyncSession, AsyncTokenStream
from kakeya.client import Client, Session, TokenStream
from kakeya.conversation import Conversation, ConverseTokenStream
from kakeya.errors import (
    Cancelled,
    DeadlineExceeded,
    InterTokenTimeout,
    InvalidArgument,
    InvariantViolation,
    KakeyaError,
    ProtocolError,
    ResourceExhausted,
    SessionNotFound,
    Unauthenticated,
    Unavailable,
)
from kakeya.types import (
    GenerationControls,
    GenerationStats,
    Grammar,
    KvCompressor,
    KvStrategy,
    ModelInfo,
    RetryPolicy,
    SamplingOptions,
    ServerLimits,
    SessionInfo,
    SessionSettings,
    StopReason,
    TlsConfig,
    TokenLogprobs,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncConversation",
    "AsyncConverseTokenStream",
    "AsyncSession",
    "AsyncTokenStream",
    "Cancelled",
    "Client",
    "Conversation",
    "ConverseTokenStream",
    "DeadlineExceeded",
    "GenerationControls",
    "GenerationStats",
    "Grammar",
    "InterTokenTimeout",
    "InvalidArgument",
    "InvariantViolation",
    "KakeyaError",
    "KvCompressor",
    "KvStrategy",
    "ModelInfo",
    "ProtocolError",
    "ResourceExhausted",
    "RetryPolicy",
    "SamplingOptions",
    "ServerLimits",
    "Session",
    "SessionInfo",
    "SessionNotFound",
    "SessionSettings",
    "StopReason",
    "TlsConfig",
    "TokenLogprobs",
    "TokenStream",
    "Unauthenticated",
    "Unavailable",
]
