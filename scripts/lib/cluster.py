"""A cluster on loopback, for the scale-out test and benchmark: a throwaway PostgreSQL server, daemons sharing its
journal, and HAProxy run with the configuration shipped in deploy/haproxy/; every process on an ephemeral port, in
temp dirs, and stopped by its `stop()`.

PostgreSQL refuses to run as root, so under root the server runs as the unprivileged `nobody` user. The Debian
package installs its binaries under /usr/lib/postgresql/<version>/bin, which is not on PATH.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg

from lib.daemon import free_port, metric_samples

REPO = Path(__file__).resolve().parents[2]
HAPROXY_CONFIG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
DAEMON_SLOTS = 3  # servers the shipped configuration names


def postgres_bin_dir() -> Path | None:
    """The directory holding `initdb` and `postgres`, or None when PostgreSQL is not installed."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("postgres"):
        return Path(os.path.realpath(on_path)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


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


def fresh_database(server: PostgresServer) -> str:
    """A new empty database on `server`; returns its URL."""
    name = f"kakeya_{os.urandom(6).hex()}"
    with psycopg.connect(server.url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    return server.url.rsplit("/", 1)[0] + "/" + name


def haproxy_binary() -> str | None:
    return shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy",) if os.path.exists(p)), None)


class ClusterDaemon:
    """One daemon of the cluster (`kakeya-runtime serve` with --journal-url): its process, its gRPC and metrics
    ports, and its JSON log records."""

    def __init__(self, name: str, journal_url: str, *extra: str) -> None:
        self.name = name
        script = Path(sys.executable).with_name("kakeya-runtime")
        command = [str(script)] if script.exists() else [sys.executable, "-m", "inference_engine.cli"]
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [
                *command,
                "serve",
                *("--port", "0", "--metrics-port", "0", "--journal-url", journal_url, "--node-name", name),
                *("--log-format", "json", "--threads", "1", *extra),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        threading.Thread(target=self._read, daemon=True).start()
        self.grpc_port = 0
        self.metrics_port = 0

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_listening(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for record in self.records():
                if record.get("msg") == "listening":
                    self.grpc_port = int(str(record["grpc"]).rsplit(":", 1)[1])
                    self.metrics_port = int(str(record["metrics_url"]).rsplit(":", 1)[1].split("/")[0])
                    return
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"daemon {self.name} did not start:\n" + "\n".join(self.lines[-30:]))

    def records(self) -> list[dict[str, object]]:
        """The daemon's JSON log records so far."""
        out = []
        for line in list(self.lines):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def metrics(self) -> dict[str, float]:
        """Its Prometheus samples without labels, by name."""
        return metric_samples(f"http://127.0.0.1:{self.metrics_port}/metrics")

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush."""
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        """SIGTERM (a graceful stop), SIGKILL if it has not exited within 30 s."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


class Proxy:
    """HAProxy run in the foreground with the shipped configuration and addresses from the environment."""

    def __init__(self, binary: str, daemons: list[ClusterDaemon]) -> None:
        if len(daemons) > DAEMON_SLOTS:
            raise ValueError(f"the shipped configuration names {DAEMON_SLOTS} daemons")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        env = {**os.environ, "KAKEYA_PROXY_BIND": self.address}
        for slot in range(DAEMON_SLOTS):
            # A slot without a daemon points at a closed port: HAProxy marks that server down at its first check.
            daemon = daemons[slot] if slot < len(daemons) else None
            env[f"KAKEYA_DAEMON_{slot + 1}"] = f"127.0.0.1:{daemon.grpc_port if daemon else free_port()}"
            env[f"KAKEYA_DAEMON_{slot + 1}_METRICS_PORT"] = str(daemon.metrics_port if daemon else free_port())
        self.log_path = Path(tempfile.mkstemp(prefix="kakeya-haproxy-", suffix=".log")[1])
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [binary, "-db", "-f", str(HAPROXY_CONFIG)], stdout=log, stderr=subprocess.STDOUT, env=env
            )
        self._wait_accepting(30.0)

    def _wait_accepting(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"haproxy exited:\n{self.log_path.read_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"haproxy did not listen within {timeout_s} s:\n{self.log_path.read_text()}")

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # hard stop: close every connection and exit
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log_path.unlink(missing_ok=True)


def start_daemons(journal_url: str, count: int, *extra: str) -> list[ClusterDaemon]:
    """Start `count` daemons together (their model loads overlap) and wait until each listens."""
    daemons = [ClusterDaemon(f"daemon{i + 1}", journal_url, *extra) for i in range(count)]
    try:
        for daemon in daemons:
            daemon.wait_listening()
    except BaseException:
        stop_daemons(daemons)
        raise
    return daemons


def stop_daemons(daemons: list[ClusterDaemon]) -> None:
    for daemon in daemons:
        if daemon.alive:
            daemon.process.terminate()
    for daemon in daemons:
        daemon.stop()
