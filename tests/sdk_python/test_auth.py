"""API-key authentication and TLS between the SDK and a real daemon."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import grpc
import kakeya
import pytest

KEY = "s3cret-key"


@pytest.fixture
def guarded(serve):
    return serve("qwen3", api_key=KEY)


def test_without_or_with_a_wrong_key_every_call_is_unauthenticated(guarded):
    with kakeya.Client(guarded.address, api_key=KEY) as good:
        sid = good.create_session(initial_tokens=[1, 2]).id
    for api_key in (None, "wrong-key"):
        with kakeya.Client(guarded.address, api_key=api_key) as client:
            session = client.session(sid)
            calls = [
                client.create_session,
                lambda s=session: s.append([3]),
                lambda s=session: list(s.generate(2)),
                session.info,
                session.close,
                session.converse,
            ]
            for call in calls:
                with pytest.raises(kakeya.Unauthenticated) as error:
                    call()
                assert error.value.status == grpc.StatusCode.UNAUTHENTICATED and "API key" in error.value.message


def test_the_right_key_opens_every_call(guarded):
    with kakeya.Client(guarded.address, api_key=KEY) as client, client.create_session(initial_tokens=[1, 2]) as session:
        assert session.append([3]) == 3
        assert len(list(session.generate(3))) == 3
        with session.converse() as conversation:
            assert conversation.append([4]) == 7
            assert len(list(conversation.generate(2))) == 2
        assert session.info().history_length == 9


def test_the_async_client_sends_the_key(guarded):
    async def main() -> None:
        async with kakeya.AsyncClient(guarded.address, api_key=KEY) as client:
            session = await client.create_session(initial_tokens=[1])
            assert len([t async for t in session.generate(2)]) == 2
            async with session.converse() as conversation:
                assert await conversation.append([2]) == 4
        async with kakeya.AsyncClient(guarded.address) as anonymous:
            with pytest.raises(kakeya.Unauthenticated):
                await anonymous.create_session()

    asyncio.run(main())


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for `localhost`, made with the openssl command-line tool."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def test_a_tls_channel_with_the_servers_certificate_and_a_key(serve, certificate):
    cert, key = certificate
    server = serve("qwen3", tls_cert=str(cert), tls_key=str(key), api_key=KEY)
    tls = kakeya.TlsConfig(root_certificates=cert.read_bytes(), server_name="localhost")
    with kakeya.Client(server.address, api_key=KEY, tls=tls) as client:
        session = client.create_session(initial_tokens=[5, 6])
        assert len(list(session.generate(3))) == 3 and session.close() == 5
    untrusted = kakeya.Client(server.address, api_key=KEY, tls=True, retry=kakeya.RetryPolicy(max_attempts=1))
    with untrusted, pytest.raises(kakeya.Unavailable):
        untrusted.create_session()
    plaintext = kakeya.Client(server.address, api_key=KEY, retry=kakeya.RetryPolicy(max_attempts=1))
    with plaintext, pytest.raises(kakeya.Unavailable):
        plaintext.create_session()
