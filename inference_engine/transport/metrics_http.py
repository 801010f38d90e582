"""The Prometheus HTTP server of the daemon, which also answers `GET /healthz` for load balancers that check over
plain HTTP (HAProxy's `option httpchk`): 200 while the gRPC health service says SERVING, 503 once it does not
(draining after SIGTERM), so a proxy stops sending new sessions to a daemon that is stopping."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

HEALTH_PATH = "/healthz"

_StartResponse = Callable[[str, list[tuple[str, str]]], Any]


def health_app(metrics_app: Callable[..., Iterable[bytes]], serving: Callable[[], bool]) -> Callable[..., Any]:
    """A WSGI app: `/healthz` says whether the daemon is serving; every other path is the metrics app."""

    def app(environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == HEALTH_PATH:
            up = serving()
            body = b"SERVING\n" if up else b"NOT_SERVING\n"
            status = "200 OK" if up else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
            return [body]
        return metrics_app(environ, start_response)

    return app


def start_metrics_server(host: str, port: int, registry: CollectorRegistry, serving: Callable[[], bool]) -> WSGIServer:
    """Serve `/metrics` (and `/healthz`) on `host:port` from a daemon thread; returns the server (`server_port`)."""

    class _Server(ThreadingWSGIServer):
        address_family = _family(host)

    app = health_app(make_wsgi_app(registry), serving)
    httpd = make_server(host.strip("[]"), port, app, _Server, handler_class=_SilentHandler)
    threading.Thread(target=httpd.serve_forever, name="kakeya-metrics", daemon=True).start()
    return httpd


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
