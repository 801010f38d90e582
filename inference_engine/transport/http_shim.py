"""The deprecated OpenAI-compatible HTTP shim: FastAPI routes over the runtime, each completion a single-shot session.

Feature-frozen: it exists so that legacy OpenAI-style clients keep working while they move to the gRPC SDKs.
Every response says so in its `Deprecation`, `Sunset` and `Link` headers (see `http_server.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from inference_engine.errors import ServiceError
from inference_engine.runtime import Runtime
from inference_engine.transport import openai_convert as convert
from inference_engine.transport.auth import bearer_matches
from inference_engine.transport.openai_schema import ApiError, ChatCompletionRequest, CompletionRequest, parse_request
from inference_engine.transport.single_shot import SingleShotGeneration
from inference_engine.transport.text_codec import TextCodec

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")

MIGRATION_GUIDE_ROUTE = "/docs/migration-from-openai.md"
# Served from a source checkout; an installed wheel has no docs/ and the route answers 404.
_MIGRATION_GUIDE_FILE = Path(__file__).resolve().parents[2] / "docs" / "migration-from-openai.md"


def build_app(runtime: Runtime, codec: TextCodec, *, model_id: str) -> FastAPI:
    """The shim's routes over `runtime`; `codec` is the served model's tokenizer, `model_id` its public name."""
    shim = _Shim(runtime, codec, model_id)
    app = FastAPI(title="kakeya OpenAI-compatible shim (deprecated)", docs_url=None, redoc_url=None, openapi_url=None)
    protected = APIRouter(dependencies=[Depends(shim.authorize)])
    protected.add_api_route("/v1/chat/completions", shim.chat_completions, methods=["POST"])
    protected.add_api_route("/v1/completions", shim.completions, methods=["POST"])
    protected.add_api_route("/v1/models", shim.list_models, methods=["GET"])
    protected.add_api_route("/v1/models/{model}", shim.get_model, methods=["GET"])
    protected.add_api_route("/metrics", shim.metrics, methods=["GET"])
    app.include_router(protected)
    app.add_api_route("/healthz", shim.health, methods=["GET"])
    app.add_api_route(MIGRATION_GUIDE_ROUTE, shim.migration_guide, methods=["GET"])
    app.add_exception_handler(ApiError, _api_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnect, _client_disconnected)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected_error_response)
    app.state.shim = shim
    return app


@dataclass(frozen=True, slots=True)
class _Format:
    """How one endpoint shapes a finished generation and its stream chunks."""

    body: Callable[[convert.Reply, str, SingleShotGeneration], dict[str, Any]]
    chunks: Callable[[convert.Reply, SingleShotGeneration, bool], AsyncIterator[dict[str, Any]]]


class _Shim:
    def __init__(self, runtime: Runtime, codec: TextCodec, model_id: str) -> None:
        self.runtime = runtime
        self.codec = codec
        self.model_id = model_id
        self.created = int(time.time())
        self.draining = False

    # -- routes ------------------------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        body = parse_request(ChatCompletionRequest, await self._read_body(request))
        self._check_model(body.model)
        prompt = self._service(self.codec.render_chat, convert.chat_messages(body))
        return await self._complete(request, body, prompt, "messages", _CHAT)

    async def completions(self, request: Request) -> Response:
        body = parse_request(CompletionRequest, await self._read_body(request))
        self._check_model(body.model)
        prompt = convert.completion_prompt(body)
        ids = self._service(self.codec.encode_prompt, prompt) if isinstance(prompt, str) else prompt
        return await self._complete(request, body, ids, "prompt", _COMPLETION)

    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [convert.model_card(self.model_id, self.created)]}

    async def get_model(self, model: str) -> dict[str, Any]:
        self._check_model(model)
        return convert.model_card(self.model_id, self.created)

    async def metrics(self) -> Response:
        return Response(generate_latest(self.runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def health(self) -> JSONResponse:
        if self.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.model_id})

    async def migration_guide(self) -> Response:
        if not _MIGRATION_GUIDE_FILE.is_file():
            raise ApiError(
                404, "the migration guide is docs/migration-from-openai.md in the source repository", code="not_found"
            )
        return PlainTextResponse(_MIGRATION_GUIDE_FILE.read_text(), media_type="text/markdown")

    async def authorize(self, request: Request) -> None:
        api_key = self.runtime.config.api_key
        if api_key and not bearer_matches(request.headers.get("authorization"), api_key):
            raise ApiError(
                401, "missing or invalid API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
            )

    # -- the generation ----------------------------------------------------------------------------------------
    async def _complete(
        self,
        request: Request,
        body: ChatCompletionRequest | CompletionRequest,
        prompt: list[int],
        prompt_param: str,
        fmt: _Format,
    ) -> Response:
        """Generate from `prompt` in a single-shot session and answer in JSON or as an event stream; the session
        is always closed, and a client that goes away cancels the generation."""
        params = convert.generate_params(body, max_generate_tokens=self.runtime.config.max_generate_tokens)
        self._check_prompt_length(len(prompt), prompt_param)
        job = self._service(
            SingleShotGeneration,
            self.runtime,
            self.codec,
            prompt,
            params,
            stop=body.stop_strings,
            label=convert.label(body),
        )
        watcher = asyncio.create_task(_call_on_disconnect(request.receive, job.disconnect))

        async def finish() -> None:
            watcher.cancel()
            await job.close()

        try:
            await job.start()
        except BaseException as exc:
            await finish()
            if isinstance(exc, ServiceError):
                raise convert.api_error(exc) from exc
            raise
        reply = convert.Reply(self.model_id)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _EventStream(_sse(fmt.chunks(reply, job, include_usage)), on_close=finish)
        try:
            text = "".join([piece async for piece in job.text()])
            return JSONResponse(fmt.body(reply, text, job))
        except ServiceError as exc:
            raise convert.api_error(exc) from exc
        finally:
            await finish()

    # -- checks ------------------------------------------------------------------------------------------------
    async def _read_body(self, request: Request) -> bytes:
        limit = self.runtime.config.max_message_bytes
        declared = request.headers.get("content-length", "")
        too_large = ApiError(413, f"the request body is over {limit} bytes (--max-message-bytes)", code="too_large")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        return bytes(body)

    def _check_model(self, model: str) -> None:
        if model != self.model_id:
            raise convert.model_not_found(model, self.model_id)

    def _check_prompt_length(self, tokens: int, param: str) -> None:
        config = self.runtime.config
        limit = min(config.max_append_tokens, config.max_history_tokens - 1)
        if tokens > limit:
            raise ApiError(
                400,
                f"the prompt is {tokens} tokens, above this server's limit of {limit} "
                "(--max-append-tokens, and --max-history-tokens less one token to generate)",
                param=param,
                code="context_length_exceeded",
            )

    @staticmethod
    def _service(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Call `fn`, turning a service error into its HTTP refusal."""
        try:
            return fn(*args, **kwargs)
        except ServiceError as exc:
            raise convert.api_error(exc) from exc


# -- stream formats ------------------------------------------------------------------------------------------------
async def _chat_chunks(reply: convert.Reply, job: SingleShotGeneration, usage: bool) -> AsyncIterator[dict[str, Any]]:
    yield convert.chat_chunk(reply, {"role": "assistant", "content": ""}, with_usage=usage)
    async for piece in job.text():
        yield convert.chat_chunk(reply, {"content": piece}, with_usage=usage)
    yield convert.chat_chunk(reply, {}, finish=convert.finish_reason(job), with_usage=usage)
    if usage:
        yield convert.usage_chunk(reply, "chat.completion.chunk", job)


async def _completion_chunks(
    reply: convert.Reply, job: SingleShotGeneration, usage: bool
) -> AsyncIterator[dict[str, Any]]:
    async for piece in job.text():
        yield convert.completion_chunk(reply, piece, with_usage=usage)
    yield convert.completion_chunk(reply, "", finish=convert.finish_reason(job), with_usage=usage)
    if usage:
        yield convert.usage_chunk(reply, "text_completion", job)


_CHAT = _Format(body=convert.chat_completion, chunks=_chat_chunks)
_COMPLETION = _Format(body=convert.completion, chunks=_completion_chunks)


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncGenerator[bytes, None]:
    """Server-sent events: one `data:` line per chunk, `data: [DONE]` after the last; an error after the stream
    started becomes an error event (the OpenAI client raises it) and ends the stream."""
    try:
        async for chunk in chunks:
            yield _event(chunk)
    except ServiceError as exc:
        yield _event(convert.api_error(exc).body())
        return
    except ApiError as exc:
        yield _event(exc.body())
        return
    yield b"data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class _EventStream(StreamingResponse):
    """An SSE response that runs `on_close` (cancel the disconnect watch, free the session) however it ends."""

    def __init__(self, events: AsyncGenerator[bytes, None], *, on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"cache-control": "no-cache", "x-accel-buffering": "no"}
        )
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The base class would cancel the stream task on disconnect; here the disconnect sets the generation's
        # cancel event instead, so the runtime stops after its current step and the session is closed in order.
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self._events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self._events.aclose()
            await self._on_close()


async def _call_on_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        while (await receive())["type"] != "http.disconnect":
            pass
        log.info("the HTTP client disconnected; its generation is cancelled")
        on_disconnect()


# -- error responses -----------------------------------------------------------------------------------------------
def _api_error_response(request: Request, exc: ApiError) -> JSONResponse:
    headers = {"www-authenticate": "Bearer"} if exc.status == 401 else None
    if exc.status >= 500:
        log.warning("request failed", extra={"path": request.url.path, "status": exc.status, "error": exc.message})
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _http_error_response(request: Request, exc: HTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return _api_error_response(request, ApiError(exc.status_code, message, code=code))


def _client_disconnected(request: Request, exc: ClientDisconnect) -> Response:
    # A client that goes away mid-body is an ordinary event: nobody is left to read a reply.
    log.info("client disconnected before sending the whole request", extra={"path": request.url.path})
    return Response(status_code=499)


def _unexpected_error_response(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error in the HTTP shim", extra={"path": request.url.path})
    return JSONResponse(ApiError(500, "internal server error", type="server_error", code="internal").body(), 500)
