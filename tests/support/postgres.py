"""A throwaway PostgreSQL server on loopback: its own data directory in a temp dir, an ephemeral port, trust auth.

PostgreSQL refuses to run as root, so under root the server runs as the unprivileged `nobody` user. The Debian
package installs the binaries under /usr/lib/postgresql/<version>/bin, which is not on PATH.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest


def postgres_bin_dir() -> Path | None:
    """The directory holding `initdb` and `postgres`, or None when PostgreSQL is not installed."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("postgres"):
        return Path(os.path.realpath(on_path)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PostgresServer:
    """A running PostgreSQL server; `url` reaches its `postgres` database as the superuser `kakeya`."""

    def __init__(self, bin_dir: Path) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="kakeya-pg-"))
        self.port = free_port()
        self.url = f"postgresql://kakeya@127.0.0.1:{self.port}/postgres"
        self.log_path = self.root / "server.log"
        user = None
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            user = nobody.pw_uid
            os.chown(self.root, nobody.pw_uid, nobody.pw_gid)
        data = self.root / "data"
        subprocess.run(
            [str(bin_dir / "initdb"), "-D", str(data), "-U", "kakeya", "--auth=trust", "--no-sync", "-E", "UTF8"],
            check=True,
            capture_output=True,
            user=user,
            cwd=self.root,
        )
        log = open(self.log_path, "w")  # noqa: SIM115 - the server writes it until stop()
        if user is not None:
            os.chown(self.log_path, user, -1)
        self.process = subprocess.Popen(
            [
                str(bin_dir / "postgres"),
                *("-D", str(data), "-p", str(self.port), "-h", "127.0.0.1", "-k", str(self.root)),
                *("-c", "fsync=off", "-c", "full_page_writes=off", "-c", "max_connections=40"),
                *("-c", "shared_buffers=16MB"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            user=user,
            cwd=self.root,
        )
        log.close()
        self._wait_ready(60.0)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited early:\n{self.log_path.read_text()}")
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                time.sleep(0.1)
        raise RuntimeError(f"postgres did not accept connections within {timeout_s} s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # fast shutdown
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server for the module's tests (import this fixture into the test module)."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed: scripts/install_system_packages.sh installs the Debian package")
    server = PostgresServer(bin_dir)
    try:
        yield server
    finally:
        server.stop()


def fresh_database(server: PostgresServer) -> str:
    """A new empty database on `server`; returns its URL."""
    name = f"kakeya_{os.urandom(6).hex()}"
    with psycopg.connect(server.url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")  # type: ignore[arg-type]
    return server.url.rsplit("/", 1)[0] + "/" + name
