"""What the console script says while it starts: JSON lines only under --log-format json, a taken port refused before
the model loads, readable startup lines with full URLs, the CPU thread count."""

from __future__ import annotations

import json
import socket
import subprocess
import time

import pytest

from tests.support.daemon import CONSOLE_SCRIPT, Daemon

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)


def _stop(daemon: Daemon) -> int:
    daemon.terminate()
    return daemon.wait()


def test_every_stderr_line_of_json_logging_parses_as_json_from_start_to_stop():
    daemon = Daemon("serve", "--port", "0", "--metrics-port", "0", "--log-format", "json", "--threads", "1")
    try:
        daemon.wait_listening()
        assert _stop(daemon) == 0
    finally:
        daemon.kill()
    records = [json.loads(line) for line in daemon.lines]  # raises on any line that is not JSON
    messages = [r["msg"] for r in records]
    assert any("Loading weights" in m for m in messages), "the weights progress bar is wrapped, not dropped"
    starting = next(r for r in records if r["msg"].startswith("starting kakeya-runtime"))
    assert starting["threads"] == 1 and "1 CPU threads" in starting["msg"]
    listening = next(r for r in records if r["msg"] == "listening")
    assert listening["metrics_url"].startswith("http://127.0.0.1:") and listening["metrics_url"].endswith("/metrics")
    assert listening["http_url"] == "off"
    assert next(r["msg"] for r in records if r["msg"].startswith("options: ")) == (
        "options: model=kakeya-tiny, port=0, metrics_port=0, threads=1, log_format=json"
    )
    readable = next(r["msg"] for r in records if r["msg"].startswith("gRPC on "))
    assert listening["metrics_url"] in readable and "plaintext" in readable


def test_text_logging_prints_readable_startup_lines_with_full_urls():
    daemon = Daemon("serve", "--port", "0", "--metrics-port", "0", "--window", "512")
    try:
        daemon.wait_listening()
        assert _stop(daemon) == 0
    finally:
        daemon.kill()
    output = daemon.output
    assert "options: model=kakeya-tiny, window=512, port=0, metrics_port=0\n" in output + "\n"
    assert "{'model'" not in output, "the configuration is not dumped as a Python dict"
    assert "Prometheus metrics at http://127.0.0.1:" in output


def test_a_port_in_use_is_refused_in_words_before_the_model_loads():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run(
            [str(CONSOLE_SCRIPT), "serve", "--port", str(port), "--metrics-port", "-1"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1
    assert f"port {port} is in use on 127.0.0.1 (the gRPC port); choose another with --port" in result.stderr
    assert "model loaded" not in result.stderr and "Loading weights" not in result.stderr
    assert time.monotonic() - started < 60


def test_a_metrics_port_in_use_is_refused_too():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [str(CONSOLE_SCRIPT), "serve", "--port", "0", "--metrics-port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1
    assert f"port {port} is in use" in result.stderr and "--metrics-port" in result.stderr
