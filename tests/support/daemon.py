"""The `kakeya-runtime` console script run as a real child process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

CONSOLE_SCRIPT = Path(sys.executable).parent / "kakeya-runtime"
_LISTENING = re.compile(r'listening grpc=(\S+):(\d+) |"msg": "listening", "grpc": "([^"]+):(\d+)"')


class Daemon:
    """A daemon process whose stderr is collected line by line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [str(CONSOLE_SCRIPT), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_listening(self, timeout_s: float = 120.0) -> tuple[str, int]:
        """Block until the daemon logs its bound address; returns (host, port)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                match = _LISTENING.search(line)
                if match:
                    host = match.group(1) or match.group(3)
                    return host, int(match.group(2) or match.group(4))
            if self.process.poll() is not None:
                raise AssertionError("daemon exited early:\n" + self.output)
            time.sleep(0.05)
        raise AssertionError("daemon did not start:\n" + self.output)

    def wait(self, timeout_s: float = 60.0) -> int:
        code = self.process.wait(timeout_s)
        self._reader.join(5)
        return code

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)
