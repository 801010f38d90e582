"""The PostgreSQL fixture, a throwaway server on loopback for one test module, and the rest of the loopback cluster
of scripts/lib/cluster.py (daemons sharing its journal, HAProxy with the shipped configuration)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from lib.cluster import (
    ClusterDaemon,
    PostgresServer,
    Proxy,
    fresh_database,
    haproxy_binary,
    postgres_bin_dir,
    start_daemons,
    stop_daemons,
)

__all__ = [
    "ClusterDaemon",
    "PostgresServer",
    "Proxy",
    "fresh_database",
    "haproxy_binary",
    "postgres",
    "start_daemons",
    "stop_daemons",
]


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
