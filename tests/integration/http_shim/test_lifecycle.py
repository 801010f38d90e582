"""Each shim request is a single-shot session that never outlives it: after a normal completion, an error, a client
disconnect (streaming or not) and a shutdown, no session is left and the generation was stopped."""

from __future__ import annotations

import re
import threading
import time

import httpx
import openai
import pytest

from tests.integration.http_shim.support import MODEL, client, metric, wait_until_no_session
from tests.support.daemon import Daemon
from tests.support.server import RunningServer

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]
LONG = 4096  # far more tokens than are generated before the client goes away


def _counters(server: RunningServer) -> dict[str, float]:
    samples = {
        "opened": "kakeya_session_opened_total",
        "closed": 'kakeya_session_total{outcome="closed"}',
        "cancelled": 'kakeya_generate_requests_total{outcome="cancelled"}',
        "max_tokens": 'kakeya_generate_requests_total{outcome="max_tokens"}',
        "tokens": "kakeya_generate_tokens_total",
    }
    out = {}
    for name, sample in samples.items():
        try:
            out[name] = metric(server, sample)
        except AssertionError:  # a labelled counter appears once it was first incremented
            out[name] = 0.0
    return out


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in before}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_completed_request_opens_and_closes_exactly_one_session(shim, stream):
    before = _counters(shim)
    if stream:
        chunks = list(
            client(shim).chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, stream=True
            )
        )
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        client(shim).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    wait_until_no_session(shim)
    change = _delta(before, _counters(shim))
    assert (change["opened"], change["closed"], change["max_tokens"], change["tokens"]) == (1, 1, 1, 6)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_request_refused_after_its_session_was_created_frees_the_session(shim, stream):
    before = _counters(shim)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client(shim).completions.create(model=MODEL, prompt=[1, 2, 10**6], max_tokens=4, stream=stream)
    wait_until_no_session(shim)
    change = _delta(before, _counters(shim))
    assert (change["opened"], change["closed"], change["tokens"]) == (1, 1, 0)


def test_a_stop_string_stops_the_generation_and_frees_the_session(shim):
    plain = client(shim).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0)
    text = plain.choices[0].message.content or ""
    stop = text[3:5]
    assert len(stop) == 2, "precondition: the greedy reply has at least five characters"
    before = _counters(shim)
    reply = client(shim).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0, stop=stop
    )
    assert reply.choices[0].finish_reason == "stop"
    wait_until_no_session(shim)
    change = _delta(before, _counters(shim))
    assert (change["opened"], change["closed"]) == (1, 1)
    assert change["cancelled"] == 1 and change["max_tokens"] == 0  # the generation was stopped at the stop string
    assert reply.usage is not None and reply.usage.completion_tokens < 30


def test_a_client_that_leaves_mid_stream_cancels_the_generation_and_frees_the_session(shim):
    before = _counters(shim)
    stream = client(shim).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=LONG, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    stream.close()  # drops the connection with the generation still running
    wait_until_no_session(shim)
    change = _delta(before, _counters(shim))
    assert change["cancelled"] == 1 and change["max_tokens"] == 0
    assert (change["opened"], change["closed"]) == (1, 1)
    assert 1 <= change["tokens"] < LONG


def test_a_client_that_gives_up_on_a_json_request_cancels_the_generation(shim):
    before = _counters(shim)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": LONG, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(shim.http_url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30.0, read=1.0))
    wait_until_no_session(shim)
    change = _delta(before, _counters(shim))
    assert change["cancelled"] == 1 and change["max_tokens"] == 0
    assert (change["opened"], change["closed"]) == (1, 1)


def _stop_in_background(server: RunningServer) -> threading.Thread:
    thread = threading.Thread(target=server.stop, name="stop-daemon")
    thread.start()
    return thread


def test_shutdown_lets_a_running_stream_finish_within_the_grace_period(serve_shim):
    server = serve_shim(shutdown_grace_s=30.0)
    stream = client(server).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks)
    stopping = _stop_in_background(server)
    rest = list(chunks)
    stopping.join(60)
    assert rest[-1].choices[0].finish_reason == "length"
    assert len(server.runtime.store) == 0


def test_shutdown_cancels_a_stream_that_outlasts_the_grace_period(serve_shim):
    server = serve_shim(shutdown_grace_s=0.2)
    stream = client(server).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=LONG, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks)
    stopping = _stop_in_background(server)
    with pytest.raises(openai.APIError, match="cancelled by the server"):
        for _ in chunks:
            pass
    stopping.join(60)
    assert not stopping.is_alive()
    assert len(server.runtime.store) == 0


def test_the_console_script_serves_the_shim_on_http_port_and_stops_on_sigterm():
    daemon = Daemon("serve", "--port", "0", "--metrics-port", "-1", "--http-port", "0", "--log-format", "json")
    try:
        daemon.wait_listening()
        match = re.search(r'"http": "127\.0\.0\.1:(\d+)"', daemon.output)
        assert match, daemon.output
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{match.group(1)}/v1", api_key="unused", max_retries=0)
        reply = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0)
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        assert "HTTP shim is deprecated" in daemon.output
        daemon.terminate()
        assert daemon.wait() == 0
        deadline = time.monotonic() + 5
        while '"msg": "stopped"' not in daemon.output and time.monotonic() < deadline:
            time.sleep(0.05)
        assert '"msg": "stopped"' in daemon.output
    finally:
        daemon.kill()


def test_a_request_under_a_state_dir_writes_no_kv_file(serve_shim, tmp_path):
    """A shim request's session ends with the request: the K/V a restart would read back are never written."""
    server = serve_shim(state_dir=str(tmp_path))
    client(server).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    wait_until_no_session(server)
    assert metric(server, "kakeya_session_kv_written_positions_total") == 0
    assert metric(server, "kakeya_session_kv_file_bytes") == 0
