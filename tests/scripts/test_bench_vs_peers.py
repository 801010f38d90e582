"""scripts/bench_agentic: the seeded agent transcripts and their chat templates, and smoke runs of bench_vs_peers.py
(our arms on the bundled model; the peers on the default model when they are installed)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.children import run_child

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "bench_agentic"
sys.path.insert(0, str(ROOT / "scripts"))

from lib.peer_servers import HttpServer, free_port, missing_peer, thread_environment  # noqa: E402

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

TINY_LENGTHS = ["--reasoning-tokens", "3-5", "--tool-result-tokens", "10-20", "--answer-tokens", "2-3"]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def transcripts() -> ModuleType:
    return _load("agent_transcripts")


def _planner(transcripts: ModuleType, tokenizer, seed: int = 0, max_history: int = 2000):
    Range = transcripts.LengthRange
    config = transcripts.TranscriptConfig(
        seed=seed,
        reasoning_tokens=Range(5, 9),
        tool_result_tokens=Range(30, 60),
        answer_tokens=Range(4, 6),
        tool_calls_per_task=Range(1, 3),
        max_history_tokens=max_history,
    )
    return transcripts.TranscriptPlanner(config, transcripts.ToolCorpus(tokenizer))


def test_the_same_seed_plans_the_same_transcripts_and_another_seed_does_not(transcripts, tokenizer):
    first = _planner(transcripts, tokenizer).plan(2, 6)
    assert first == _planner(transcripts, tokenizer).plan(2, 6)
    assert first != _planner(transcripts, tokenizer, seed=1).plan(2, 6)
    assert first[0] != first[1], "each agent draws its own transcript"


def test_a_transcript_calls_tools_gets_real_results_and_ends_each_task_with_a_generated_answer(transcripts, tokenizer):
    turns = _planner(transcripts, tokenizer).plan_agent(0, 12)
    assert len(turns) == 12 and [t.index for t in turns] == list(range(12))
    opening = turns[0]
    assert opening.new_conversation and opening.messages[0]["role"] == "system"
    assert "<tools>" in opening.messages[0]["content"] and "read_file" in opening.messages[0]["content"]
    names = {tool["name"] for tool in transcripts.TOOLS}
    for turn, following in itertools.pairwise(turns):
        assert 5 <= turn.reasoning_tokens <= 9
        added = following.messages[-1]
        if turn.tool_call is not None:
            assert turn.answer_tokens == 0
            call = json.loads(turn.tool_call.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
            assert call["name"] in names and call["arguments"]
            assert added["role"] == "user" and added["content"].startswith("<tool_response>\n")
            assert len(tokenizer.encode(added["content"], add_special_tokens=False)) <= 60 + 20
        else:
            assert 4 <= turn.answer_tokens <= 6
            assert added["role"] == "user" and not added["content"].startswith("<tool_response>"), "a new request"
    assert any(t.tool_call is None for t in turns) and any(t.tool_call is not None for t in turns)


def test_an_agent_opens_a_new_conversation_rather_than_outgrow_its_history(transcripts, tokenizer):
    turns = _planner(transcripts, tokenizer, max_history=600).plan_agent(0, 30)
    assert sum(t.new_conversation for t in turns) > 1
    assert all(t.history_tokens <= 600 for t in turns)
    assert all((t.messages[0]["role"] == "system") == t.new_conversation for t in turns)


def test_round_robin_takes_one_turn_of_every_agent_in_turn(transcripts, tokenizer):
    order = transcripts.round_robin(_planner(transcripts, tokenizer).plan(3, 2))
    assert [(t.agent, t.index) for t in order] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_the_drop_template_re_renders_earlier_reasoning_and_the_append_only_one_extends(transcripts, tokenizer):
    system = {"role": "system", "content": "S"}
    call = {"role": "assistant", "content": "<think>\nfirst thoughts\n</think>\n<tool_call>\n{}\n</tool_call>"}
    result = {"role": "user", "content": "<tool_response>\nR\n</tool_response>"}
    answer = {"role": "assistant", "content": "<think>\nsecond thoughts\n</think>\nthe answer"}
    steps = [[system, {"role": "user", "content": "Q1"}]]
    steps.append([*steps[-1], call, result])
    steps.append([*steps[-1], answer, {"role": "user", "content": "Q2"}])

    def render(template: str, messages: list[dict[str, str]]) -> str:
        text = transcripts.load_template(template)
        return tokenizer.apply_chat_template(messages, chat_template=text, tokenize=False, add_generation_prompt=True)

    append_only = [render("append_only", m) for m in steps]
    assert all(text.endswith("<|im_start|>assistant\n<think>\n") for text in append_only)
    assert append_only[1].startswith(append_only[0]) and append_only[2].startswith(append_only[1])
    dropped = [render("drop_reasoning", m) for m in steps]
    assert dropped[:2] == append_only[:2], "a tool result is not a new request: the reasoning stays"
    assert "first thoughts" not in dropped[2] and "second thoughts" not in dropped[2]
    assert "<tool_call>" in dropped[2] and "the answer" in dropped[2]
    continued = render("append_only", [*steps[1], {"role": "assistant", "content": "<think>\nso far"}])
    assert continued.endswith("<|im_start|>assistant\n<think>\nso far"), "a last assistant message is continued"


def _run(tmp_path: Path, *args: str) -> dict:
    command = [sys.executable, str(BENCH / "bench_vs_peers.py"), *args, "--out", str(tmp_path), "--quiet"]
    result = run_child(command, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    [report] = tmp_path.glob("bench_vs_peers_*.json")
    assert report.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    payload = json.loads(report.read_text())
    payload["stderr"] = result.stderr
    return payload


def test_our_arms_run_interleaved_agents_through_a_restart_and_count_what_they_process(tmp_path):
    args = ["--model", "kakeya-tiny", "--arms", "ours,shim", "--workloads", "2x3", "--templates", "drop_reasoning"]
    report = _run(tmp_path, *args, *TINY_LENGTHS, "--tool-calls-per-task", "1", "--max-history-tokens", "4000")
    samples = report["samples"]
    ours = [s for s in samples if s["arm"] == "ours"]
    shim = [s for s in samples if s["arm"] == "shim"]
    assert len(ours) == len(shim) == 6 and report["config"]["complete"]
    assert [(s["agent"], s["turn"]) for s in ours] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert [s["after_restart"] for s in ours] == [False, False, False, True, True, False]
    assert [s["new_tokens"] for s in ours] == [s["new_tokens"] for s in shim], "the same transcript on both arms"
    # The second agent's first turn copies the system prompt's K/V from the first agent's session; every other turn
    # processes exactly what it added, the first turn after the restart too (its K/V read back from the state dir).
    borrowed = [s for s in ours if s["agent"] > 0 and s["turn"] == 0]
    assert borrowed and all(0 < s["processed_tokens"] < s["new_tokens"] for s in borrowed)
    assert all(s["processed_tokens"] == s["new_tokens"] for s in ours if s not in borrowed)
    assert all(s["processed_tokens"] == s["prompt_tokens"] * s["requests"] for s in shim if s["requests"] == 1)
    assert all(s["processed_tokens"] > s["new_tokens"] for s in shim if not s["new_conversation"])
    gates = report["summary"]["gates"]
    assert gates["ours_processes_only_each_turns_new_tokens"]["pass"] is True
    assert gates["ours_after_restart_processes_nothing_again"]["pass"] is True
    runs = {r["arm"]: r for r in report["summary"]["runs"]}
    assert "state-dir" in runs["ours"]["restart"]["how"] and runs["shim"]["restart"]["restart_s"] > 0
    assert runs["ours"]["wall_s"] == pytest.approx(sum(s["latency_s"] for s in ours))
    assert set(report["summary"]["ours_wall_over"]["2x3/drop_reasoning"]) == {"shim"}


def test_the_peers_run_on_the_default_model_when_installed(tmp_path, smollm2_dir):
    missing = {name: reason for name in ("llama", "mlx") if (reason := missing_peer(name))}
    if len(missing) == 2:
        pytest.skip("; ".join(missing.values()))
    args = ["--model", str(smollm2_dir), "--arms", "llama,mlx", "--workloads", "1x3", "--templates", "append_only"]
    args.append("--llama-args=--no-repack")  # its AMX products crash where the CPU has AMX (docs/benchmarks.md)
    report = _run(tmp_path, *args, *TINY_LENGTHS, "--tool-calls-per-task", "1")
    runs = {r["arm"]: r for r in report["summary"]["runs"]}
    for arm in ("llama", "mlx"):
        if arm in missing:
            continue
        turns = [s for s in report["samples"] if s["arm"] == arm]
        assert "error" not in runs[arm] and len(turns) == 3
        assert all(s["processed_tokens"] > 0 and s["output_tokens"] > 0 for s in turns)
        assert turns[0]["processed_tokens"] == turns[0]["prompt_tokens"], "the first prompt is processed whole"
    if "llama" not in missing:
        assert runs["llama"]["restart"]["restored_tokens"] > 0, "llama-server's slots came back after the restart"
    for name, reason in missing.items():
        assert f"skipping {name}: {reason}" in report["stderr"]


def test_a_peer_that_dies_while_starting_says_of_what_and_what_to_try():
    crash = "import os, signal; print('loading', flush=True); os.kill(os.getpid(), signal.SIGSEGV)"
    crashing = [sys.executable, "-c", crash]
    server = HttpServer("crasher", crashing, free_port(), "/health", thread_environment(1), "try --safer")
    with pytest.raises(RuntimeError, match=r"crasher died of SIGSEGV while starting \(try --safer\)") as caught:
        server.start(timeout_s=60)
    assert "loading" in str(caught.value)  # the end of its log

    exiting = HttpServer("quitter", [sys.executable, "-c", "raise SystemExit(3)"], free_port(), "/health", {})
    with pytest.raises(RuntimeError, match="quitter exited with status 3 while starting;"):
        exiting.start(timeout_s=60)
