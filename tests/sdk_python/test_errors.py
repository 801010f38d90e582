"""Every gRPC status the runtime returns reaches the caller as its typed SDK exception with the server's message."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import kakeya
import pytest

from tests.sdk_python.conftest import busy_slot
from tests.support.checkpoints import VOCAB_SIZE
from tests.support.server import start_server


def test_every_error_class_shares_one_base_and_names_its_status():
    classes = {
        kakeya.SessionNotFound: grpc.StatusCode.NOT_FOUND,
        kakeya.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
        kakeya.InvariantViolation: grpc.StatusCode.FAILED_PRECONDITION,
        kakeya.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
        kakeya.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
        kakeya.Cancelled: grpc.StatusCode.CANCELLED,
        kakeya.Unavailable: grpc.StatusCode.UNAVAILABLE,
        kakeya.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    }
    for cls, status in classes.items():
        assert issubclass(cls, kakeya.KakeyaError) and cls.status_code == status
    assert issubclass(kakeya.InterTokenTimeout, kakeya.DeadlineExceeded)
    assert issubclass(kakeya.DeadlineExceeded, TimeoutError) and issubclass(kakeya.InvalidArgument, ValueError)


def test_an_unknown_session_is_session_not_found_on_every_call(client):
    ghost = client.session("no-such-session")
    calls = [
        lambda: ghost.append([1]),
        lambda: list(ghost.generate(2)),
        ghost.info,
        ghost.close,
        ghost.converse,
    ]
    for call in calls:
        with pytest.raises(kakeya.SessionNotFound) as error:
            call()
        assert error.value.status == grpc.StatusCode.NOT_FOUND and "no-such-session" in error.value.message
        assert str(error.value).startswith("NOT_FOUND: ")


def test_input_the_server_rejects_is_invalid_argument_with_its_message(client):
    session = client.create_session(initial_tokens=[1, 2])
    with pytest.raises(kakeya.InvalidArgument) as error:
        session.append([VOCAB_SIZE])
    assert error.value.status == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in error.value.message
    for kwargs in ({"max_tokens": 4, "temperature": float("nan")}, {"max_tokens": 4, "top_p": 1.5}):
        with pytest.raises(kakeya.InvalidArgument) as error:
            list(session.generate(**kwargs))
        assert error.value.status == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(kakeya.InvalidArgument):
        client.create_session(kv_strategy="full", sink_tokens=2)
    assert session.info().history_length == 2


def test_an_invariant_violation_is_invariant_violation_and_the_session_is_gone(server, client):
    session = client.create_session(initial_tokens=[1, 2, 3, 4])
    list(session.generate(3))
    cache = server.runtime.store.get(session.id, touch=False).seq.cache
    cache._layers[0].held += 1  # corrupt one layer's bookkeeping inside the running daemon
    with pytest.raises(kakeya.InvariantViolation) as error:
        list(session.generate(3))
    assert error.value.status == grpc.StatusCode.FAILED_PRECONDITION and "inv1" in error.value.message
    with pytest.raises(kakeya.SessionNotFound):
        session.info()


def test_a_server_limit_is_resource_exhausted(serve):
    server = serve("qwen3", max_append_tokens=50)
    with kakeya.Client(server.address) as client:
        session = client.create_session(initial_tokens=[1])
        with pytest.raises(kakeya.ResourceExhausted) as error:
            session.append([1] * 51)
        assert "--max-append-tokens" in error.value.message
        assert session.append([1] * 50) == 51


def test_a_unary_call_past_the_client_deadline_is_deadline_exceeded(server, client):
    blocker = busy_slot(client)
    with kakeya.Client(server.address, timeout_s=0.3) as impatient:
        busy = impatient.session(blocker.session.id)
        with pytest.raises(kakeya.DeadlineExceeded) as error:
            busy.append([5])  # waits for the generating session's turn
        assert error.value.status == grpc.StatusCode.DEADLINE_EXCEEDED
    blocker.cancel()


def test_a_generation_past_its_deadline_is_deadline_exceeded(client):
    blocker = busy_slot(client)
    waiting = client.create_session(initial_tokens=[4, 5])
    with pytest.raises(kakeya.DeadlineExceeded) as error:
        list(waiting.generate(4, timeout_s=0.3))
    assert not isinstance(error.value, kakeya.InterTokenTimeout)
    blocker.cancel()


def test_a_stream_cancelled_from_another_thread_raises_cancelled_in_its_reader(client):
    blocker = busy_slot(client)
    stream = client.create_session(initial_tokens=[4, 5]).generate(4)  # queued behind the blocker: no event comes
    timer = threading.Timer(0.3, stream.cancel)
    timer.start()
    with pytest.raises(kakeya.Cancelled) as error:
        next(stream)
    assert error.value.status == grpc.StatusCode.CANCELLED
    assert stream.stats is not None and stream.stats.stop_reason is kakeya.StopReason.CANCELLED
    timer.join()
    blocker.cancel()


def test_nothing_listening_is_unavailable(free_port):
    with kakeya.Client(f"127.0.0.1:{free_port}", retry=kakeya.RetryPolicy(max_attempts=1)) as client:
        with pytest.raises(kakeya.Unavailable) as error:
            client.create_session()
        assert error.value.status == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(kakeya.Unavailable):
            client.wait_until_ready(0.2)


def test_a_server_shutting_down_is_unavailable_with_its_message(verifiers, verifier_pool):
    model_dir = verifier_pool.model_dir("torch", "qwen3")
    server = start_server(verifiers["qwen3"], model_dir=model_dir, shutdown_grace_s=120.0)  # stopped by this test
    client = kakeya.Client(server.address)
    idle = client.create_session(initial_tokens=[1, 2])
    stream = client.create_session(initial_tokens=[3, 4]).generate(40)
    next(stream)  # a generation in flight keeps the server draining for its grace period
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    with pytest.raises(kakeya.Unavailable) as error:
        for _ in range(1000):
            idle.append([1])  # accepted until the server starts draining
    assert "shutting down" in error.value.message
    for _ in stream:
        pass  # the in-flight generation finishes within the grace period
    assert stream.stats.stop_reason is kakeya.StopReason.MAX_TOKENS
    stopper.join(150)
    assert not stopper.is_alive()
    client.close()


def test_a_status_without_its_own_class_maps_to_the_base_class():
    bare = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # a real server that serves no Kakeya service
    port = bare.add_insecure_port("127.0.0.1:0")
    bare.start()
    try:
        with kakeya.Client(f"127.0.0.1:{port}") as client, pytest.raises(kakeya.KakeyaError) as error:
            client.create_session()
        assert type(error.value) is kakeya.KakeyaError and error.value.status == grpc.StatusCode.UNIMPLEMENTED
    finally:
        bare.stop(None)
