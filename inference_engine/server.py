"""Assembles and runs the daemon: gRPC (service, health, reflection), Prometheus metrics, the optional deprecated
HTTP shim, idle sweeps, shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from inference_engine.config import ConfigError, ServerConfig
from inference_engine.durable_kv import KV_DIR
from inference_engine.generated import runtime_pb2
from inference_engine.journal import Journal, JournalDamaged, open_journal, open_shared_journal
from inference_engine.metrics import Metrics
from inference_engine.model_source import choose_weights
from inference_engine.runtime import Runtime
from inference_engine.threads import on_a_passing_thread
from inference_engine.transport.auth import ApiKeyInterceptor
from inference_engine.transport.grpc_handlers import add_runtime_service
from inference_engine.transport.grpc_service import RuntimeServicer
from inference_engine.transport.http_server import HttpShimServer
from inference_engine.transport.metrics_http import start_metrics_server
from inference_engine.transport.text_codec import TextCodec
from kv_cache_proposer.backends import load_verifier, runs_on_cpu
from kv_cache_proposer.backends.mlx_blas import use_mlx_blas
from kv_cache_proposer.proposers import load_proposer
from kv_cache_proposer.verifier import Verifier

log = logging.getLogger(__name__)

_CANCEL_WAIT_S = 0.5  # for cancelled generations to finish their step
_RPC_DRAIN_S = 0.3  # for unary calls still in flight once the generations are done

SERVICE_NAME = runtime_pb2.DESCRIPTOR.services_by_name["RuntimeService"].full_name


def load_runtime(config: ServerConfig, metrics: Metrics | None = None) -> Runtime:
    """Load the configured model and proposer and wrap them in a runtime."""
    if config.backend == "mlx":
        try:
            blas = use_mlx_blas(config.mlx_blas)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        log.info("MLX CPU BLAS: %s", blas, extra={"mlx_blas": blas.library})
    weights, why = choose_weights(
        config.weights, config.model_dir, backend=config.backend, on_cpu=runs_on_cpu(config.backend, config.device)
    )
    log.info("weights: %s (%s)", weights, why, extra={"weights": weights})
    config = dataclasses.replace(config, weights=weights)  # what the journal records: auto resolved
    verifier: Verifier = load_verifier(
        config.backend,
        config.model_dir,
        device=config.device,
        dtype=config.dtype,
        torch_forward=config.torch_forward,
        compile=config.compile,
        weights=weights,
        kv_dtype=config.kv_dtype,
    )
    log.info("model loaded", extra={"model": str(config.model_dir), "verifier": verifier.description})
    options = config.proposer_options()
    proposer = load_proposer(
        options,
        verifier,
        backend=config.backend,
        device=config.device,
        dtype=config.dtype,
        torch_forward=config.torch_forward,
        compile=config.compile,
    )
    if config.proposer != "none":
        log.info("proposer loaded", extra={"proposer": proposer.name, "model": str(options.draft_model or "-")})
    return Runtime(verifier, config, metrics or Metrics(), proposer=proposer)


class KakeyaServer:
    """The running daemon around one runtime."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.config = runtime.config
        self.port = 0
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._metrics_http: object | None = None
        self._http: HttpShimServer | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._journal: Journal | None = None

    async def start(self) -> None:
        config = self.config
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        interceptors = [ApiKeyInterceptor(config.api_key)] if config.api_key else []
        if config.state_dir:
            on_a_passing_thread(self._restore_sessions, Path(config.state_dir))  # no OpenMP pool stays behind
        elif config.journal_url:
            self._open_shared_journal()
        server = grpc.aio.server(options=options, interceptors=interceptors)
        add_runtime_service(RuntimeServicer(self.runtime), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = f"{_bracket(config.host)}:{config.port}"
        if config.tls_cert:
            credentials = grpc.ssl_server_credentials(
                [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())]
            )
            self.port = _add_port(lambda: server.add_secure_port(address, credentials), config.port)
        else:
            self.port = _add_port(lambda: server.add_insecure_port(address), config.port)
        await server.start()
        self._server = server
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if config.metrics_port >= 0:
            httpd = start_metrics_server(config.host, config.metrics_port, self.runtime.metrics.registry, self.serving)
            self._metrics_http = httpd
            self.metrics_port = httpd.server_port
        if config.http_port >= 0:
            await self._start_http_shim()
        self._sweeper = asyncio.create_task(self._sweep_idle())
        host = _bracket(config.host)
        metrics_url = f"http://{host}:{self.metrics_port}/metrics" if self.metrics_port is not None else "off"
        scheme = "https" if config.tls_cert else "http"
        http_url = f"{scheme}://{host}:{self.http_port}/v1" if self.http_port is not None else "off"
        log.info(
            "listening",
            extra={
                "grpc": f"{config.host}:{self.port}",
                "metrics_url": metrics_url,
                "http_url": http_url,
                "tls": bool(config.tls_cert),
                "auth": bool(config.api_key),
            },
        )
        log.info(
            "gRPC on %s:%s (%s, %s); Prometheus metrics at %s; HTTP shim %s",
            host,
            self.port,
            "TLS" if config.tls_cert else "plaintext",
            "API key required" if config.api_key else "no API key",
            metrics_url,
            f"at {http_url}" if self.http_port is not None else "off",
        )

    def serving(self) -> bool:
        """Whether the daemon takes new work (False once it drains); `/healthz` and the gRPC health service agree."""
        return self._server is not None and self.runtime.accepting

    async def stop(self) -> None:
        """Graceful stop: refuse new work, let generations finish within the grace period, then cancel them."""
        grace = self.config.shutdown_grace_s
        log.info("shutting down", extra={"grace_s": grace, "generating": self.runtime.active_generations})
        self.runtime.stop_accepting()
        await self._health.enter_graceful_shutdown()
        if self._http is not None:
            self._http.begin_shutdown()
        if not await self.runtime.wait_idle(grace):
            log.warning("grace period over, cancelling generations", extra={"left": self.runtime.active_generations})
            self.runtime.cancel_all()
            # Running generations stop after their current step and queued ones end as they get their turn, so
            # every stream ends with CANCELLED or UNAVAILABLE before the server goes (exit within grace + 1 s).
            if not await self.runtime.wait_idle(_CANCEL_WAIT_S):
                log.warning(
                    "generations still running after cancellation", extra={"left": self.runtime.active_generations}
                )
        if self._http is not None:
            await self._http.wait_stopped(5.0)
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            await self._server.stop(_RPC_DRAIN_S)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()  # type: ignore[attr-defined]
        self.runtime.shutdown()
        if self._journal is not None:
            self._journal.close()
        log.info("stopped")

    async def serve_until_signal(self) -> None:
        """Run until SIGTERM or SIGINT, then stop gracefully."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        await stop.wait()
        await self.stop()

    async def _start_http_shim(self) -> None:
        codec = TextCodec.load(self.config.model_dir)
        if codec.missing_reason:
            log.warning("the HTTP shim can only refuse completions: %s", codec.missing_reason)
        elif not codec.has_chat_template:
            log.warning("the model's tokenizer has no chat template: the HTTP shim refuses chat completions")
        self._http = HttpShimServer(self.runtime, codec)
        self.http_port = await self._http.start()
        log.warning(
            "the OpenAI-compatible HTTP shim is deprecated; move clients to the gRPC SDKs "
            "(docs/migration-from-openai.md)",
            extra={"http": f"{self.config.host}:{self.http_port}"},
        )

    def _restore_sessions(self, state_dir: Path) -> None:
        """Open the session journal and bring its sessions back; raises `JournalError` when it must not be used."""
        config = self.config
        opened = open_journal(
            state_dir, self.runtime.journal_identity(), sync=config.journal_sync, recovery=config.journal_recovery
        )
        self._journal = opened.journal
        self.runtime.attach_journal(opened.journal)
        kv_dir = state_dir / KV_DIR
        if config.state_kv == "on":
            self.runtime.keep_kv(kv_dir)
        elif kv_dir.is_dir():
            shutil.rmtree(kv_dir, ignore_errors=True)
            log.info("K/V files removed (--state-kv off): restored sessions prefill", extra={"dir": str(kv_dir)})
        salvage = config.journal_recovery == "salvage"
        try:
            dropped = opened.dropped + self.runtime.restore_sessions(opened.records, drop_invalid=salvage)
        except JournalDamaged as exc:
            opened.journal.close()
            raise JournalDamaged(
                f"{exc}. Nothing was changed; start with --journal-recovery salvage to drop that session"
            ) from None
        if opened.moved_to is not None or dropped:
            log.warning(
                "session journal salvaged",
                extra={"moved_to": str(opened.moved_to or "-"), "dropped": "; ".join(dropped) or "nothing"},
            )
        log.info(
            "sessions restored",
            extra={"sessions": len(self.runtime.store), "journal": opened.journal.backend.location},
        )

    def _open_shared_journal(self) -> None:
        """Join the cluster journal: sessions come to this daemon as their calls do (docs/scale-out.md)."""
        config = self.config
        node = config.node_name or f"{socket.gethostname()}:{config.port or os.getpid()}"
        opened = open_shared_journal(
            config.journal_url, self.runtime.journal_identity(), node=node, sync=config.journal_sync
        )
        self._journal = opened.journal
        self.runtime.attach_journal(opened.journal)
        log.info("shared session journal opened", extra={"journal": opened.journal.backend.location, "node": node})

    async def _sweep_idle(self) -> None:
        interval = min(30.0, max(0.05, self.config.session_idle_ttl_s / 4))
        while True:
            await asyncio.sleep(interval)
            self.runtime.evict_idle()


def _add_port(add: Callable[[], int], port: int) -> int:
    """Bind the gRPC port; grpc reports a taken port as a bare RuntimeError, said here in words."""
    try:
        return add()
    except RuntimeError as exc:
        raise OSError(f"port {port} is in use, or the address cannot be bound ({exc})") from None


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
