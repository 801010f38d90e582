"""Bearer API-key authentication for the gRPC server."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

_EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


def bearer_matches(header: str | None, api_key: str) -> bool:
    """Constant-time check of an `authorization` value against `Bearer <api_key>`."""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <key>` with UNAUTHENTICATED (health checks stay open)."""

    def __init__(self, api_key: str) -> None:
        self._api_key = api_key

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if method.startswith(_EXEMPT_PREFIXES):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if bearer_matches(metadata.get("authorization"), self._api_key):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return _denying(handler) if handler is not None else handler


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key (authorization: Bearer <key>)")


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that rejects the call."""
    serializers = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_deny, **serializers)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_deny, **serializers)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_deny, **serializers)
    return grpc.stream_stream_rpc_method_handler(_deny, **serializers)
