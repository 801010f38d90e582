"""The `kakeya.v1.RuntimeService` servicer: decodes requests, calls the runtime, encodes events and errors."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import NoReturn

import grpc

from inference_engine.errors import InvalidArgument, ServiceError
from inference_engine.generated import runtime_pb2 as pb
from inference_engine.generated import runtime_pb2_grpc
from inference_engine.logs import request_id
from inference_engine.runtime import Runtime
from inference_engine.transport import convert


def _begin(context: grpc.aio.ServicerContext) -> None:
    """Tag the call's log lines with the client's `x-request-id` (or a fresh one) and echo it back."""
    metadata = dict(context.invocation_metadata() or ())
    value = metadata.get("x-request-id")
    rid = value if isinstance(value, str) and value else secrets.token_hex(8)
    request_id.set(rid)
    context.set_trailing_metadata((("x-request-id", rid),))


async def _abort(context: grpc.aio.ServicerContext, exc: ServiceError) -> NoReturn:
    await context.abort(convert.STATUS_CODES[exc.status], exc.message)
    raise AssertionError("context.abort returned")


class RuntimeServicer(runtime_pb2_grpc.RuntimeServiceServicer):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateSessionResponse:
        _begin(context)
        try:
            session_id, history = await self.runtime.create_session(convert.create_params(request))
        except ServiceError as exc:
            await _abort(context, exc)
        return pb.CreateSessionResponse(session_id=session_id, history_length=history)

    async def AppendTokens(
        self, request: pb.AppendTokensRequest, context: grpc.aio.ServicerContext
    ) -> pb.AppendTokensResponse:
        _begin(context)
        try:
            history = await self.runtime.append(request.session_id, request.token_ids)
        except ServiceError as exc:
            await _abort(context, exc)
        return pb.AppendTokensResponse(history_length=history)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        _begin(context)
        try:
            events = self.runtime.generate(request.session_id, convert.generate_params(request))
            async with aclosing(events):
                async for event in events:
                    yield convert.generate_response(event)
        except ServiceError as exc:
            await _abort(context, exc)

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseSessionResponse:
        _begin(context)
        try:
            history = await self.runtime.close_session(request.session_id)
        except ServiceError as exc:
            await _abort(context, exc)
        return pb.CloseSessionResponse(final_history_length=history)

    async def GetSessionInfo(
        self, request: pb.GetSessionInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetSessionInfoResponse:
        _begin(context)
        try:
            await self.runtime.acquire(request.session_id, touch=False)
            await self.runtime.settle_cancellations(request.session_id)
            info = self.runtime.session_info(request.session_id, request.history_tail_tokens)
        except ServiceError as exc:
            await _abort(context, exc)
        return convert.session_info(info)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        _begin(context)
        return convert.model_info(self.runtime.model_info())

    async def ForkSession(
        self, request: pb.ForkSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.ForkSessionResponse:
        _begin(context)
        try:
            prefix = request.prefix_tokens if request.HasField("prefix_tokens") else None
            label = request.client_label if request.HasField("client_label") else None
            session_id, history, copied = await self.runtime.fork_session(request.session_id, prefix, label)
        except ServiceError as exc:
            await _abort(context, exc)
        return pb.ForkSessionResponse(session_id=session_id, history_length=history, copied_token_count=copied)

    def Converse(
        self, request_iterator: AsyncIterator[pb.ConverseRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ConverseResponse]:
        _begin(context)
        return _Conversation(self.runtime, context).run(request_iterator)


@dataclass(slots=True)
class _Command:
    request: pb.ConverseRequest
    cancel: asyncio.Event | None = None


@dataclass
class _Conversation:
    """One Converse stream: commands run in order; a cancel command stops every generation commanded before it."""

    runtime: Runtime
    context: grpc.aio.ServicerContext
    session_id: str | None = None
    _generation_cancels: list[asyncio.Event] = field(default_factory=list)

    async def run(self, requests: AsyncIterator[pb.ConverseRequest]) -> AsyncGenerator[pb.ConverseResponse, None]:
        """The stream's responses; a command's error ends the stream with its status."""
        queue: asyncio.Queue[_Command | None] = asyncio.Queue()
        reader = asyncio.create_task(self._read(requests, queue))
        try:
            while (command := await queue.get()) is not None:
                request = command.request
                if request.WhichOneof("command") != "generate":
                    yield await self._execute(command)
                    continue
                if self.session_id is None:
                    raise InvalidArgument("the first command of a Converse stream must be bind")
                params = convert.generate_params(request.generate)
                events = self.runtime.generate(self.session_id, params, cancel=command.cancel)
                async with aclosing(events):
                    async for event in events:
                        yield convert.converse_response(request.command_id, event)
                if command.cancel is not None and command.cancel in self._generation_cancels:
                    self._generation_cancels.remove(command.cancel)
            await reader
        except ServiceError as exc:
            await _abort(self.context, exc)
        finally:
            reader.cancel()

    async def _read(self, requests: AsyncIterator[pb.ConverseRequest], queue: asyncio.Queue[_Command | None]) -> None:
        try:
            async for request in requests:
                kind = request.WhichOneof("command")
                if kind == "cancel":
                    for event in self._generation_cancels:
                        event.set()
                    self._generation_cancels.clear()
                    continue
                command = _Command(request)
                if kind == "generate":
                    command.cancel = asyncio.Event()
                    self._generation_cancels.append(command.cancel)
                await queue.put(command)
        finally:
            await queue.put(None)

    async def _execute(self, command: _Command) -> pb.ConverseResponse:
        """A command other than generate: its one response."""
        request = command.request
        kind = request.WhichOneof("command")
        command_id = request.command_id
        if kind == "bind":
            if self.session_id is not None:
                raise InvalidArgument("the stream is already bound to a session")
            await self.runtime.acquire(request.bind.session_id, touch=False)
            info = self.runtime.session_info(request.bind.session_id)
            self.session_id = request.bind.session_id
            return pb.ConverseResponse(command_id=command_id, bound=pb.BoundEvent(history_length=info.history_length))
        if self.session_id is None:
            raise InvalidArgument("the first command of a Converse stream must be bind")
        if kind == "append":
            history = await self.runtime.append(self.session_id, request.append.token_ids)
            return pb.ConverseResponse(command_id=command_id, appended=pb.AppendedEvent(history_length=history))
        raise InvalidArgument("a Converse command must set one of bind, append, generate or cancel")
