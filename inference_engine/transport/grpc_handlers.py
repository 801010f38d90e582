"""Registers the `RuntimeService` servicer with request bodies parsed here rather than by grpc, so a body that is
not a valid protobuf message is an `INVALID_ARGUMENT` naming the message (grpc's own deserializer failure surfaces
as `UNKNOWN` with a traceback in the log)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError, Message

from inference_engine.errors import InvalidArgument
from inference_engine.generated import runtime_pb2
from inference_engine.transport import convert

SERVICE = runtime_pb2.DESCRIPTOR.services_by_name["RuntimeService"]

_Unary = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
_Streaming = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]


def parse_request(raw: bytes, message: type[Message]) -> Any:
    """`raw` as a `message`; `InvalidArgument` when it is not one."""
    try:
        return message.FromString(raw)
    except (DecodeError, ValueError) as exc:
        raise InvalidArgument(
            f"the request body is not a valid {message.DESCRIPTOR.full_name} message: {exc}"
        ) from None


async def _abort_invalid(context: grpc.aio.ServicerContext, exc: InvalidArgument) -> NoReturn:
    await context.abort(convert.STATUS_CODES[exc.status], exc.message)
    raise AssertionError("context.abort returned")


def _unary(impl: _Unary, message: type[Message]) -> _Unary:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = parse_request(raw, message)
        except InvalidArgument as exc:
            await _abort_invalid(context, exc)
        return await impl(request, context)

    return handle


def _server_streaming(impl: _Streaming, message: type[Message]) -> _Streaming:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            request = parse_request(raw, message)
        except InvalidArgument as exc:
            await _abort_invalid(context, exc)
        async with aclosing(impl(request, context)) as responses:  # type: ignore[type-var]
            async for response in responses:
                yield response

    return handle


def _bidi_streaming(impl: _Streaming, message: type[Message]) -> _Streaming:
    # A bad body in the stream raises InvalidArgument where the servicer reads it, and ends the call with it.
    async def handle(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async def parsed() -> AsyncIterator[Any]:
            async for raw in requests:
                yield parse_request(raw, message)

        async with aclosing(impl(parsed(), context)) as responses:  # type: ignore[type-var]
            async for response in responses:
                yield response

    return handle


def add_runtime_service(servicer: object, server: grpc.aio.Server) -> None:
    """Serve `servicer`'s methods for every RPC of `RuntimeService`."""
    handlers = {}
    for method in SERVICE.methods:
        request_type = getattr(runtime_pb2, method.input_type.name)
        response_type = getattr(runtime_pb2, method.output_type.name)
        impl = getattr(servicer, method.name)
        serialize = response_type.SerializeToString
        if method.client_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _bidi_streaming(impl, request_type), response_serializer=serialize
            )
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _server_streaming(impl, request_type), response_serializer=serialize
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(impl, request_type), response_serializer=serialize
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
