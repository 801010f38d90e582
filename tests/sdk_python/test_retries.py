"""Retries with backoff on UNAVAILABLE for idempotent calls only; appends, creations and generations never."""

from __future__ import annotations

import asyncio
import logging
import threading

import kakeya
import pytest

from tests.sdk_python.conftest import FAST_RETRY
from tests.support.server import start_server


def _retries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kakeya" and r.getMessage().startswith("retrying")]


def _unsafe_retries(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Retries of calls other than GetModelInfo, which generate() and create_session() ask first (idempotent)."""
    return [line for line in _retries(caplog) if not line.startswith("retrying GetModelInfo ")]


def test_idempotent_calls_are_retried_and_the_others_are_not(free_port, caplog):
    caplog.set_level(logging.INFO, logger="kakeya")
    with kakeya.Client(f"127.0.0.1:{free_port}", retry=FAST_RETRY) as client:
        session = client.session("any-session")
        for name, call in (("GetSessionInfo", session.info), ("CloseSession", session.close)):
            caplog.clear()
            with pytest.raises(kakeya.Unavailable):
                call()
            retries = _retries(caplog)
            assert len(retries) == FAST_RETRY.max_attempts - 1 and all(name in line for line in retries)
        for call in (lambda: session.append([1]), lambda: list(session.generate(2)), client.create_session):
            caplog.clear()
            with pytest.raises(kakeya.Unavailable):
                call()
            assert _unsafe_retries(caplog) == []
        caplog.clear()
        with pytest.raises(kakeya.Unavailable):
            session.converse()
        assert _retries(caplog) == []


def test_async_idempotent_calls_are_retried_and_the_others_are_not(free_port, caplog):
    caplog.set_level(logging.INFO, logger="kakeya")

    async def main() -> None:
        async with kakeya.AsyncClient(f"127.0.0.1:{free_port}", retry=FAST_RETRY) as client:
            session = client.session("any-session")
            with pytest.raises(kakeya.Unavailable):
                await session.info()
            assert len(_retries(caplog)) == FAST_RETRY.max_attempts - 1
            caplog.clear()
            with pytest.raises(kakeya.Unavailable):
                await session.append([1])
            with pytest.raises(kakeya.Unavailable):
                [t async for t in session.generate(2)]
            assert _retries(caplog) == []

    asyncio.run(main())


def test_a_retried_call_reaches_a_server_that_starts_later(verifiers, verifier_pool, backend, free_port, caplog):
    caplog.set_level(logging.INFO, logger="kakeya")
    servers = []
    model_dir = verifier_pool.model_dir(backend, "qwen3")
    starter = threading.Timer(
        0.5, lambda: servers.append(start_server(verifiers["qwen3"], model_dir=model_dir, port=free_port))
    )
    starter.start()
    patient = kakeya.RetryPolicy(max_attempts=40, initial_backoff_s=0.1, max_backoff_s=0.5)
    try:
        with kakeya.Client(f"127.0.0.1:{free_port}", retry=patient, timeout_s=60) as client:
            with pytest.raises(kakeya.SessionNotFound):
                client.session("not-on-the-new-server").info()  # the answer comes from the server, once it is up
            assert _retries(caplog), "the first attempts found nothing listening"
            assert client.create_session(initial_tokens=[1]).info().history_length == 1
    finally:
        starter.join()
        for server in servers:
            server.stop()


def test_all_attempts_share_the_call_deadline(free_port, caplog):
    caplog.set_level(logging.INFO, logger="kakeya")
    slow = kakeya.RetryPolicy(max_attempts=50, initial_backoff_s=0.2, max_backoff_s=0.2)
    client = kakeya.Client(f"127.0.0.1:{free_port}", retry=slow, timeout_s=1.0)
    with client, pytest.raises(kakeya.Unavailable):
        client.session("x").info()
    assert 1 <= len(_retries(caplog)) <= 10, "the 1 s deadline ends the retries long before 50 attempts"


def test_a_retry_policy_validates_itself_and_backs_off_exponentially_up_to_its_ceiling():
    policy = kakeya.RetryPolicy(max_attempts=6, initial_backoff_s=0.1, max_backoff_s=0.4, multiplier=2.0)
    for attempt, ceiling in ((1, 0.1), (2, 0.2), (3, 0.4), (6, 0.4)):
        delays = [policy.backoff_s(attempt) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
    for bad in (
        {"max_attempts": 0},
        {"initial_backoff_s": 0},
        {"initial_backoff_s": 1.0, "max_backoff_s": 0.5},
        {"multiplier": 0.5},
    ):
        with pytest.raises(kakeya.InvalidArgument):
            kakeya.RetryPolicy(**bad)
