"""A cluster on loopback for tests and benchmarks: daemons sharing a PostgreSQL journal behind HAProxy run with the
configuration shipped in deploy/haproxy/, every process on an ephemeral port and stopped by `stop()`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.support.daemon import Daemon
from tests.support.postgres import free_port

REPO = Path(__file__).resolve().parents[2]
HAPROXY_CONFIG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
DAEMON_SLOTS = 3  # servers the shipped configuration names


def haproxy_binary() -> str | None:
    return shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy",) if os.path.exists(p)), None)


class ClusterDaemon:
    """One daemon of the cluster: its process, gRPC and metrics ports, and its JSON log lines."""

    def __init__(self, name: str, journal_url: str, *extra: str) -> None:
        self.name = name
        self.daemon = Daemon(
            "serve",
            *("--port", "0", "--metrics-port", "0", "--journal-url", journal_url, "--node-name", name),
            *("--log-format", "json", "--threads", "1", *extra),
        )
        self.grpc_port = 0
        self.metrics_port = 0

    def wait_listening(self, timeout_s: float = 180.0) -> None:
        _, self.grpc_port = self.daemon.wait_listening(timeout_s)
        for record in self.records():
            if record.get("msg") == "listening":
                self.metrics_port = int(str(record["metrics_url"]).rsplit(":", 1)[1].split("/")[0])

    def records(self) -> list[dict[str, object]]:
        """The daemon's JSON log records so far."""
        out = []
        for line in list(self.daemon.lines):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def metrics(self) -> dict[str, float]:
        """Its Prometheus samples without labels, by name."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    @property
    def alive(self) -> bool:
        return self.daemon.process.poll() is None


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
            self.process.send_signal(signal.SIGUSR1)  # soft stop: finish the connections, then exit
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
            daemon.daemon.terminate()
    for daemon in daemons:
        try:
            daemon.daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.daemon.kill()
