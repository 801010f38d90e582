"""The servers the agent bench drives, as child processes on free loopback ports: the daemon (its gRPC service and
its HTTP shim), llama.cpp's `llama-server` on a GGUF file and `mlx_lm.server` on an mlx-lm directory.

Every server can be killed with SIGKILL and started again with the same command. The peers are installed by
scripts/bench_agentic/install_peers.sh; `missing_peer` says what is missing and how to install it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lib.daemon import Daemon, free_port

PEERS_DIR = Path(os.environ.get("KAKEYA_PEERS_DIR") or Path.home() / ".cache" / "kakeya" / "peers")
LLAMA_SERVER = PEERS_DIR / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server"
INSTALL_PEERS = "scripts/bench_agentic/install_peers.sh"
_HTTP_URL = re.compile(r'"http_url": "([^"]+)"')
# mlx_lm.server started after MLX's CPU BLAS is chosen, as the daemon chooses it (--mlx-blas).
_MLX_SERVER = (
    "import sys\n"
    "from kv_cache_proposer.backends.mlx_blas import use_mlx_blas\n"
    "print('MLX CPU BLAS:', use_mlx_blas(sys.argv[1]), file=sys.stderr, flush=True)\n"
    "sys.argv = ['mlx_lm.server', *sys.argv[2:]]\n"
    "from mlx_lm.server import main\n"
    "main()\n"
)


def missing_peer(name: str) -> str | None:
    """Why the peer `name` (`llama` or `mlx`) cannot run here, with how to install it; None when it can."""
    if name == "llama" and not LLAMA_SERVER.is_file():
        return f"llama-server is not built at {LLAMA_SERVER}: run {INSTALL_PEERS}"
    if name == "mlx":
        try:
            import mlx_lm.server  # noqa: F401
        except ImportError as exc:
            return f"mlx_lm.server cannot be imported ({exc}): run {INSTALL_PEERS}"
    return None


def thread_environment(threads: int) -> dict[str, str]:
    """The environment that limits a child's OpenMP / BLAS threads to `threads`, waiting passively."""
    limits = dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), str(threads))
    return {**os.environ, **limits, "OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "4"}


class HttpServer:
    """A child process answering HTTP on a loopback port; ready once `health_path` answers 200. Its output goes to a
    log file, kept across restarts and removed by `stop`."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        port: int,
        health_path: str,
        env: dict[str, str],
        crash_hint: str = "",
    ) -> None:
        """`crash_hint`: what to try when the server dies of a signal while starting."""
        self.name = name
        self.crash_hint = crash_hint
        self.command = list(command)
        self.port = port
        self.health_path = health_path
        self.env = env
        self.log = Path(tempfile.mkstemp(prefix=f"kakeya-{name}-", suffix=".log")[1])
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def openai_url(self) -> str:
        """The base URL of its OpenAI-compatible API."""
        return self.url + "/v1"

    def start(self, timeout_s: float = 300.0) -> None:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.2)
        tail, ended = self.log_tail(), self.process.poll()
        self.stop()
        if ended is None:
            raise RuntimeError(f"{self.name} did not answer within {timeout_s:.0f} s; the end of its log:\n{tail}")
        how = f"died of {signal.Signals(-ended).name}" if ended < 0 else f"exited with status {ended}"
        hint = f" ({self.crash_hint})" if ended < 0 and self.crash_hint else ""
        raise RuntimeError(f"{self.name} {how} while starting{hint}; the end of its log:\n{tail}")

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            answer: dict[str, Any] = json.loads(reply.read())
            return answer

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=60) as reply:
            return json.loads(reply.read())

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to save anything."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(30)

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 30 s), then remove the log."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.unlink(missing_ok=True)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def llama_server(
    gguf: Path,
    template: Path,
    *,
    threads: int,
    slots: int,
    context_tokens: int,
    cache_ram_mib: int,
    cache_reuse_tokens: int,
    slot_dir: Path,
    extra: Sequence[str] = (),
) -> HttpServer:
    """llama-server on `gguf` set up for several clients as its README describes: `slots` slots sharing one unified
    KV buffer of `context_tokens`, idle slots kept in a host-memory prompt cache of `cache_ram_mib`, KV shifting to
    reuse chunks of at least `cache_reuse_tokens`, slot save/restore in `slot_dir`; the chat template from
    `template` (Jinja), a last assistant message continued by the template itself, replies returned unparsed;
    `extra` flags last."""
    hint = (
        "where the CPU has AMX, the llama.cpp that install_peers.sh builds multiplies repacked weights on it and "
        "has crashed doing so: --llama-args=--no-repack keeps its AVX-512 products"
    )
    port = free_port()
    command = [
        str(LLAMA_SERVER),
        *("--model", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
        *("--threads", str(threads), "--threads-batch", str(threads)),
        *("--parallel", str(slots), "--kv-unified", "--ctx-size", str(context_tokens)),
        *("--cache-ram", str(cache_ram_mib), "--cache-reuse", str(cache_reuse_tokens)),
        *("--slot-save-path", str(slot_dir)),
        *("--jinja", "--chat-template-file", str(template), "--no-prefill-assistant", "--skip-chat-parsing"),
        *("--reasoning-format", "none", "--no-webui"),
        *extra,
    ]
    return HttpServer("llama-server", command, port, "/health", thread_environment(threads), hint)


def mlx_server(model_dir: Path, template: Path, *, threads: int, prompt_cache_size: int, blas: str) -> HttpServer:
    """mlx_lm.server on the mlx-lm directory `model_dir` with its prompt cache (`prompt_cache_size` entries), the
    chat template from `template`, greedy by default, MLX's CPU BLAS chosen by `blas` (as the daemon's
    --mlx-blas) and limited to `threads` threads."""
    port = free_port()
    command = [
        *(sys.executable, "-c", _MLX_SERVER, blas),
        *("--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port)),
        *("--chat-template", template.read_text(), "--prompt-cache-size", str(prompt_cache_size)),
        *("--temp", "0", "--log-level", "INFO"),
    ]
    return HttpServer("mlx_lm.server", command, port, "/health", thread_environment(threads))


class DaemonProcess:
    """`kakeya-runtime serve` with `flags`, restartable; `http_url` is its shim's base URL when it serves one."""

    def __init__(self, flags: Sequence[str]) -> None:
        self.flags = list(flags)
        self.daemon: Daemon | None = None
        self.address = ""
        self.http_url = ""

    def start(self) -> None:
        self.daemon = Daemon(self.flags)
        self.address = self.daemon.wait_listening(600.0)
        found = [match.group(1) for line in self.daemon.lines if (match := _HTTP_URL.search(line))]
        self.http_url = found[0] if found else ""

    def kill(self) -> None:
        if self.daemon is not None and self.daemon.process.poll() is None:
            self.daemon.process.send_signal(signal.SIGKILL)
            self.daemon.process.wait(30)

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()

    @property
    def command(self) -> list[str]:
        return self.daemon.command if self.daemon is not None else []

    @property
    def openai_url(self) -> str:
        """The base URL of its HTTP shim's OpenAI-compatible API (empty when it serves none)."""
        return self.http_url
