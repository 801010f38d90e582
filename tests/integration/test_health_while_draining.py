"""A draining daemon tells load balancers to stop sending it work: from SIGTERM until it exits, `GET /healthz` on
its metrics port answers 503 and the gRPC health service NOT_SERVING, while a running generation still streams."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_engine.generated import runtime_pb2 as pb
from inference_engine.generated import runtime_pb2_grpc
from tests.support.daemon import Daemon


def _healthz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as reply:
            return reply.status, reply.read().decode().strip()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode().strip()


def test_healthz_and_grpc_health_say_not_serving_while_the_daemon_drains() -> None:
    daemon = Daemon("serve", "--port", "0", "--metrics-port", "0", "--log-format", "json", "--shutdown-grace-s", "20")
    try:
        host, port = daemon.wait_listening()
        listening = next(json.loads(line) for line in daemon.lines if '"listening"' in line)
        metrics_port = int(listening["metrics_url"].rsplit(":", 1)[1].split("/")[0])
        assert _healthz(metrics_port) == (200, "SERVING")
        channel = grpc.insecure_channel(f"{host}:{port}")
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
        session_id = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=[5, 6, 7])).session_id
        stream = stub.Generate(pb.GenerateRequest(session_id=session_id, max_tokens=8000))
        received: list[int] = []
        first = threading.Event()

        def read() -> None:
            try:
                for reply in stream:
                    if reply.WhichOneof("payload") == "token_id":
                        received.append(reply.token_id)
                        first.set()
            except grpc.RpcError as error:  # the test cancels the stream once it has seen enough
                assert error.code() == grpc.StatusCode.CANCELLED

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert first.wait(60)
        daemon.terminate()
        deadline = time.monotonic() + 10
        while _healthz(metrics_port)[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _healthz(metrics_port) == (503, "NOT_SERVING")
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        streamed = len(received)
        time.sleep(0.3)
        assert len(received) > streamed, "the generation in flight goes on while the daemon drains"
        stream.cancel()
        channel.close()
        assert daemon.wait(30) == 0
    finally:
        daemon.kill()
