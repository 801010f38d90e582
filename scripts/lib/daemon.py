"""The daemon as a child process for scripts: `kakeya-runtime serve` on a free loopback port."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

_LISTENING = re.compile(r'"msg": "listening", "grpc": "([^"]+)"')
_METRICS_URL = re.compile(r'"metrics_url": "(http://[^"]+)"')


def metric_samples(url: str) -> dict[str, float]:
    """A daemon's Prometheus samples without labels, by name, from its /metrics `url`."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def free_port() -> int:
    """A loopback port with nothing listening on it (bound once, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Daemon:
    """`kakeya-runtime serve` as a child process on a free loopback port."""

    def __init__(self, flags: Sequence[str], env: Mapping[str, str | None] | None = None) -> None:
        """`env`: variables set for the daemon over this process's environment (None: removed)."""
        merged = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        script = Path(sys.executable).with_name("kakeya-runtime")
        command = [str(script)] if script.exists() else [sys.executable, "-m", "inference_engine.cli"]
        self.command = [*command, "serve", "--port", "0", "--metrics-port", "-1", "--log-format", "json", *flags]
        self.lines: list[str] = []
        self.address: str | None = None
        self.metrics_url: str | None = None  # with `--metrics-port` among the flags, once it listens
        self._listening = threading.Event()
        self.process = subprocess.Popen(
            self.command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={name: value for name, value in merged.items() if value is not None},
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            if len(self.lines) < 200:
                self.lines.append(line.rstrip())
            if self.address is None and (match := _LISTENING.search(line)):
                self.address = match.group(1)
                if metrics := _METRICS_URL.search(line):
                    self.metrics_url = metrics.group(1)
                self._listening.set()

    def wait_listening(self, timeout_s: float = 180.0) -> str:
        deadline = time.monotonic() + timeout_s
        while not self._listening.wait(0.1):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the daemon did not start:\n" + "\n".join(self.lines[-30:]))
        assert self.address is not None
        return self.address

    def metrics(self) -> dict[str, float]:
        """Its Prometheus samples without labels, by name (`--metrics-port` among its flags)."""
        if self.metrics_url is None:
            raise RuntimeError("the daemon serves no metrics: start it with --metrics-port 0")
        return metric_samples(self.metrics_url)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
