"""SIGTERM with generations queued behind --max-concurrent: every stream ends within the grace period, the
daemon exits 0 within grace + 1 s, and the log holds no traceback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from inference_engine.generated import runtime_pb2 as pb
from inference_engine.generated import runtime_pb2_grpc
from tests.support.daemon import Daemon

GRACE_S = 1.5
STREAMS = 4


@pytest.fixture
def daemon() -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    yield started
    for process in started:
        process.kill()


def test_sigterm_ends_running_and_queued_streams_within_the_grace_period(daemon, tmp_path):
    process = Daemon(
        "serve",
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--max-concurrent",
        "1",
        "--shutdown-grace-s",
        str(GRACE_S),
        "--state-dir",
        str(tmp_path / "state"),
    )
    daemon.append(process)
    host, port = process.wait_listening()
    outcomes: list[str | None] = [None] * STREAMS
    ended_at: list[float] = [0.0] * STREAMS
    first_token = threading.Event()

    with grpc.insecure_channel(f"{host}:{port}") as channel:
        stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
        sessions = [
            stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=[1, 2, 3 + i])).session_id
            for i in range(STREAMS)
        ]

        def consume(index: int) -> None:
            request = pb.GenerateRequest(session_id=sessions[index], max_tokens=8000)
            try:
                for reply in stub.Generate(request, timeout=60):
                    if reply.WhichOneof("payload") == "token_id":
                        first_token.set()
                    elif reply.WhichOneof("payload") == "done":
                        outcomes[index] = pb.StopReason.Name(reply.done.stop_reason)
            except grpc.RpcError as exc:
                outcomes[index] = exc.code().name
            ended_at[index] = time.monotonic()

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(STREAMS)]
        for thread in threads:
            thread.start()
        assert first_token.wait(60)
        time.sleep(0.3)  # the other three are queued behind the one running
        signalled = time.monotonic()
        process.terminate()
        code = process.wait(30)
        exited = time.monotonic()
        for thread in threads:
            thread.join(10)

    assert code == 0
    assert exited - signalled <= GRACE_S + 1.0, f"exit took {exited - signalled:.2f} s"
    for index, outcome in enumerate(outcomes):
        assert outcome in ("STOP_REASON_CANCELLED", "UNAVAILABLE"), (index, outcome)
        assert ended_at[index] - signalled <= GRACE_S + 1.0
    assert outcomes.count("STOP_REASON_CANCELLED") >= 1, "the running stream ends with GenerateDone"
    assert "Traceback" not in process.output and "CancelledError" not in process.output, process.output
