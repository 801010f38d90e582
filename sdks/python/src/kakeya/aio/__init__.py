"""The asyncio client (grpc.aio): `AsyncClient`, `AsyncSession`, their token streams and conversations."""

from kakeya.aio.client import AsyncClient, AsyncSession, AsyncTokenStream
from kakeya.aio.conversation import AsyncConversation, AsyncConverseTokenStream

__all__ = ["AsyncClient", "AsyncConversation", "AsyncConverseTokenStream", "AsyncSession", "AsyncTokenStream"]
