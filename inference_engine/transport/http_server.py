"""Serves the HTTP shim with uvicorn inside the daemon's event loop, next to the gRPC server.

The daemon owns signal handling and shutdown order; every response carries the deprecation headers and a
request id, whichever layer produced it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Iterator
from datetime import UTC, datetime
from email.utils import format_datetime

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inference_engine.logs import request_id
from inference_engine.runtime import Runtime
from inference_engine.transport.http_shim import MIGRATION_GUIDE_ROUTE, build_app
from inference_engine.transport.text_codec import TextCodec

log = logging.getLogger(__name__)

DEPRECATED_AT = datetime(2026, 11, 1, tzinfo=UTC)
SUNSET_AT = datetime(2027, 6, 30, tzinfo=UTC)
DEPRECATION_HEADERS = (
    (b"deprecation", f"@{int(DEPRECATED_AT.timestamp())}".encode()),  # RFC 9745 structured date
    (b"sunset", format_datetime(SUNSET_AT, usegmt=True).encode()),  # RFC 8594 HTTP-date
    (b"link", f'<{MIGRATION_GUIDE_ROUTE}>; rel="deprecation"; type="text/markdown"'.encode()),
)


class ShimHeaders:
    """ASGI wrapper: tags the request with an id (the client's `x-request-id` or a fresh one) for the logs and
    adds it and the deprecation headers to every response, errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", ())).get(b"x-request-id", b"").decode("latin-1")
        rid = given or secrets.token_hex(8)
        request_id.set(rid)
        extra = (*DEPRECATION_HEADERS, (b"x-request-id", rid.encode("latin-1")))

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves SIGINT/SIGTERM to the daemon, which stops it in its own shutdown order."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpShimServer:
    """The shim's HTTP server bound next to the gRPC port (same host, API key and TLS)."""

    def __init__(self, runtime: Runtime, codec: TextCodec) -> None:
        self.runtime = runtime
        model_id = runtime.model_dir_info.name
        self.app = build_app(runtime, codec, model_id=model_id)
        self.port = 0
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind and start serving; returns the bound port. A bind or TLS error is raised here."""
        config = self.runtime.config
        sock = _listen(config.host, config.http_port)
        server_config = uvicorn.Config(
            ShimHeaders(self.app),
            log_config=None,
            lifespan="off",
            ws="none",
            server_header=False,
            ssl_certfile=config.tls_cert or None,
            ssl_keyfile=config.tls_key or None,
            timeout_graceful_shutdown=max(1, int(config.shutdown_grace_s) + 5),
        )
        try:
            server_config.load()
        except BaseException:
            sock.close()
            raise
        self._server = _EmbeddedServer(server_config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="kakeya-http-shim")
        while not self._server.started:
            if self._task.done():
                await self._task
                raise RuntimeError("the HTTP shim stopped while starting")
            await asyncio.sleep(0.01)
        self.port = int(sock.getsockname()[1])
        return self.port

    def begin_shutdown(self) -> None:
        """Stop accepting connections; requests in flight go on until they end."""
        self.app.state.shim.draining = True
        if self._server is not None:
            self._server.should_exit = True

    async def wait_stopped(self, timeout_s: float) -> None:
        """Wait for the server to finish its in-flight responses; past `timeout_s` they are cut."""
        if self._task is None:
            return
        self.begin_shutdown()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except TimeoutError:
            log.warning("HTTP shim responses outlasted the shutdown; closing them")
            assert self._server is not None
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _listen(host: str, port: int) -> socket.socket:
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    return socket.create_server((bare, port), family=family)
