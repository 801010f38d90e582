"""A real daemon on a loopback ephemeral port, running in a background thread with its own event loop."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from inference_engine.config import ServerConfig
from inference_engine.generated import runtime_pb2 as pb
from inference_engine.generated import runtime_pb2_grpc
from inference_engine.metrics import Metrics
from inference_engine.model_dir_info import ModelDirInfo
from inference_engine.runtime import Runtime
from inference_engine.server import KakeyaServer
from kv_cache_proposer.proposers import load_proposer
from kv_cache_proposer.verifier import Verifier

T = TypeVar("T")


@dataclass
class RunningServer:
    server: KakeyaServer
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    channel: grpc.Channel = field(init=False)
    stub: runtime_pb2_grpc.RuntimeServiceStub = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.address)
        self.stub = runtime_pb2_grpc.RuntimeServiceStub(self.channel)

    @property
    def runtime(self) -> Runtime:
        return self.server.runtime

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def http_url(self) -> str:
        """Base URL of the HTTP shim (started with `http_port=0`)."""
        assert self.server.http_port is not None, "start the server with http_port=0 to get the HTTP shim"
        return f"http://127.0.0.1:{self.server.http_port}"

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run a coroutine on the server's event loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def metrics_text(self) -> str:
        assert self.server.metrics_port is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{self.server.metrics_port}/metrics", timeout=10) as reply:
            return reply.read().decode()

    def stop(self) -> None:
        self.channel.close()
        if self.loop.is_running():
            self.call(self.server.stop())
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


def start_server(verifier: Verifier, *, model_dir: Path | None = None, **overrides: Any) -> RunningServer:
    """Start a daemon serving `verifier` with `ServerConfig` overrides (port and metrics port are ephemeral).

    `model_dir` is the directory `verifier` was loaded from, whose facts (end-of-sequence ids, context length)
    the server reports; without it they come from the configured model directory (the bundled model by default).
    """
    settings: dict[str, Any] = {
        "model": "kakeya-tiny",
        "port": 0,
        "metrics_port": 0,
        "shutdown_grace_s": 2.0,
        **overrides,
    }
    config = ServerConfig(**settings)
    proposer = load_proposer(config.proposer_options(), verifier, backend=config.backend)
    info = ModelDirInfo.read(model_dir) if model_dir is not None else None
    runtime = Runtime(verifier, config, Metrics(), proposer=proposer, model_dir_info=info)
    server = KakeyaServer(runtime)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.start())
        except BaseException as exc:  # surfaced to the test thread below
            failure.append(exc)
            started.set()
            return
        started.set()
        loop.run_forever()
        loop.close()

    thread = threading.Thread(target=run, name="kakeya-test-server", daemon=True)
    thread.start()
    started.wait(60)
    if failure:
        raise failure[0]
    return RunningServer(server, loop, thread)


@dataclass
class Generation:
    """What one Generate stream delivered."""

    tokens: list[int]
    done: pb.GenerateDone | None
    truncated: list[int]
    scored: list[pb.TokenLogprobs] = field(default_factory=list)  # when the request asked for logprobs


def create(stub: runtime_pb2_grpc.RuntimeServiceStub, initial: list[int] | None = None, **kwargs: Any) -> str:
    reply = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=initial or [], **kwargs))
    return str(reply.session_id)


def generate(stub: runtime_pb2_grpc.RuntimeServiceStub, session_id: str, **kwargs: Any) -> Generation:
    kwargs.setdefault("max_tokens", 16)
    tokens: list[int] = []
    truncated: list[int] = []
    scored: list[pb.TokenLogprobs] = []
    done = None
    for reply in stub.Generate(pb.GenerateRequest(session_id=session_id, **kwargs)):
        kind = reply.WhichOneof("payload")
        if kind == "token_id":
            tokens.append(reply.token_id)
        elif kind == "scored_token":
            tokens.append(reply.scored_token.token_id)
            scored.append(reply.scored_token)
        elif kind == "truncated":
            truncated.append(reply.truncated.dropped_token_count)
        else:
            done = reply.done
    return Generation(tokens, done, truncated, scored)


def info(stub: runtime_pb2_grpc.RuntimeServiceStub, session_id: str, tail: int = 0) -> pb.GetSessionInfoResponse:
    return stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=session_id, history_tail_tokens=tail))


def converse(
    stub: runtime_pb2_grpc.RuntimeServiceStub, commands: list[pb.ConverseRequest]
) -> list[pb.ConverseResponse]:
    return list(stub.Converse(iter(commands)))
