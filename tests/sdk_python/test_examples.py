"""Every SDK example runs to completion against a real daemon serving the bundled model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from tests.support.children import run_child
from tests.support.server import RunningServer, start_server

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "sdks" / "python" / "examples"
BUNDLED = ROOT / "inference_engine" / "models" / "kakeya-tiny"


@pytest.fixture(scope="module")
def bundled_server():
    server = start_server(TorchVerifier.load(BUNDLED, device="cpu", dtype="float32"), max_concurrent=2)
    yield server
    server.stop()


def _run(example: str, server: RunningServer, *args: str, stdin: str = "") -> str:
    result = run_child([sys.executable, str(EXAMPLES / example), "--address", server.address, *args], input=stdin)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_every_example_is_covered_here():
    assert {p.name for p in EXAMPLES.glob("*.py")} == {
        "streaming_chat.py",
        "async_agents.py",
        "template_hazard.py",
        "tool_call.py",
    }


def test_the_streaming_chat_answers_every_line(bundled_server):
    out = _run(
        "streaming_chat.py",
        bundled_server,
        "--tokenizer",
        str(BUNDLED),
        "--max-tokens",
        "12",
        stdin="hello\nand again\n",
    )
    reports = [line for line in out.splitlines() if line.startswith("[") and "tokens, prefilled" in line]
    assert len(reports) == 2
    assert int(reports[1].rsplit("history ", 1)[1].split()[0]) > int(reports[0].rsplit("history ", 1)[1].split()[0])


def test_the_async_agents_run_side_by_side(bundled_server):
    out = _run("async_agents.py", bundled_server, "--agents", "3", "--steps", "2", "--max-tokens", "8")
    assert sorted(line.split(":")[0] for line in out.splitlines() if ": history " in line) == [
        "agent-0",
        "agent-1",
        "agent-2",
    ]
    assert sum("[agent-" in line for line in out.splitlines()) == 6


def test_the_template_hazard_example_shows_the_hazard_and_the_append_only_fix(bundled_server):
    out = _run("template_hazard.py", bundled_server, "--turns", "3", "--max-tokens", "8")
    assert "NOT an extension" in out and "<think>" in out
    assert out.count("equals the append-only sequence") == 3
    assert "re-rendering hazards: 2; append-only mismatches: 0" in out


def test_the_tool_call_example_parses_a_schema_valid_call_and_answers(bundled_server):
    out = _run("tool_call.py", bundled_server, "--answer-tokens", "10")
    lines = out.splitlines()
    call = json.loads(next(line for line in lines if line.startswith("tool call: ")).removeprefix("tool call: "))
    assert call["tool"] in ("add", "weather") and set(call["arguments"]) == {"a", "b", "city"}
    assert any(line.startswith("tool result: ") for line in lines)
    report = lines[-1]
    assert report.split(":")[0] in ("[stop_sequence", "[max_tokens", "[eos"), report
    assert "mean token probability" in report
