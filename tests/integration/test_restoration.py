"""`dlm_restore` through the daemon: the tokens of `full` over evicting turns with no HistoryTruncated event,
restoration bytes in GetSessionInfo, the SDK and /metrics, the restoration plan a server loads, and a plan whose
f_θ was distilled on attention through fork and restart."""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import kakeya
import numpy as np
import pytest

from inference_engine.config import ConfigError
from inference_engine.generated import runtime_pb2 as pb
from kv_cache_proposer.restoration import LayerSource, LinearProjection, RestorationPlan
from kv_cache_proposer.restoration.plan import plan_from_spec
from tests.support.backends import BACKENDS
from tests.support.checkpoints import VOCAB_SIZE
from tests.support.server import create, generate, info

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from lib.distill import DistillSettings, distill_plan
from lib.restoration import fit_projections, kv_rows_by_layer

RESTORE = {"kv_strategy": "dlm_restore", "sink": 2, "window": 9}


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE - 1) for _ in range(n)]


def _conversation(server, prompt: list[int]) -> tuple[str, list[int], list[int]]:
    """Three evicting turns on one session: returns its id, the tokens and every HistoryTruncated count."""
    sid = create(server.stub, initial=prompt)
    tokens, truncated = [], []
    for turn in range(3):
        if turn:
            server.stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=_prompt(turn, 6)))
        result = generate(server.stub, sid, max_tokens=10)
        tokens += result.tokens
        truncated += result.truncated
    return sid, tokens, truncated


@pytest.mark.parametrize("backend", BACKENDS)
def test_dlm_restore_streams_the_tokens_of_full_and_never_reports_truncation(serve, backend):
    full, restoring, bounded = (
        serve("qwen3"),
        serve("qwen3", **RESTORE),
        serve("qwen3", **{**RESTORE, "kv_strategy": "sink_window"}),
    )
    prompt = _prompt(11, 40)
    _, expected, _ = _conversation(full, prompt)
    sid, tokens, truncated = _conversation(restoring, prompt)
    assert tokens == expected and truncated == []
    described = info(restoring.stub, sid)
    assert described.kv_strategy == pb.KV_STRATEGY_DLM_RESTORE
    assert described.evicted_token_count == described.history_length - 1 - 11 > 0
    # Parked: resident K/V plus the token ids a `recompute` plan rebuilds from (reported apart), no restored K/V.
    assert described.restored_token_count == 0 and described.kv_restored_bytes == 0
    assert described.kv_restoration_state_bytes == 0
    assert described.history_token_bytes == 4 * (described.history_length - 1)
    # The default proposer's n-gram index counts too, as the session's drafting state.
    assert described.kv_live_bytes == (
        described.kv_resident_bytes + described.history_token_bytes + described.draft_state_bytes
    )
    assert described.draft_state_bytes > 0
    assert described.kv_peak_restored_bytes > 0
    bounded_sid = create(bounded.stub, initial=prompt)
    assert generate(bounded.stub, bounded_sid, max_tokens=2).truncated  # the same eviction is reported there


def test_restoration_bytes_reach_the_python_sdk_and_metrics(serve):
    server = serve("qwen3", **RESTORE)
    with kakeya.Client(server.address) as client:
        session = client.create_session(initial_tokens=_prompt(3, 30))
        assert len(list(session.generate(max_tokens=5))) == 5
        described = session.info()
    assert described.kv_strategy is kakeya.KvStrategy.DLM_RESTORE
    # `recompute` keeps no K/V of evicted positions, only the token ids it rebuilds them from.
    assert described.kv_restoration_state_bytes == 0 and described.kv_restored_bytes == 0
    assert described.history_token_bytes == 4 * (described.history_length - 1)
    assert "history_token_bytes" in repr(described)
    text = server.metrics_text()
    state = re.search(r"^kakeya_kv_restoration_state_bytes (\S+)$", text, re.MULTILINE)
    peak = re.search(r"^kakeya_kv_restored_peak_bytes (\S+)$", text, re.MULTILINE)
    assert state and float(state.group(1)) == described.kv_restoration_state_bytes
    token_ids = re.search(r"^kakeya_history_token_bytes (\S+)$", text, re.MULTILINE)
    assert token_ids and float(token_ids.group(1)) == described.history_token_bytes > 0
    assert peak and float(peak.group(1)) == described.kv_peak_restored_bytes > 0


def test_a_server_loads_the_restoration_plan_it_is_given(serve, tmp_path):
    heads_dim = 2 * 2 * 16  # K and V rows of the tiny qwen3: 2 KV heads x 16
    identity = LinearProjection(np.eye(heads_dim, dtype=np.float32), np.zeros(heads_dim, dtype=np.float32))
    plan = RestorationPlan(
        (LayerSource("tokens"), LayerSource("kept"), LayerSource("projected", from_layer=1, projection=identity))
    )
    manifest = plan.save(tmp_path / "plan.json")
    server = serve("qwen3", **RESTORE, restore_plan=str(manifest))
    sid, tokens, truncated = _conversation(server, _prompt(5, 40))
    described = info(server.stub, sid)
    evicted = described.evicted_token_count
    # Parked: exactly one kept layer, K and V of 2 heads x 16 fp32 values per evicted position; token ids apart.
    assert described.kv_restoration_state_bytes == evicted * 2 * 2 * 16 * 4
    assert described.history_token_bytes == 4 * (described.history_length - 1)
    assert len(tokens) == 30 and truncated == []


def test_a_plan_that_does_not_fit_the_model_stops_the_server(serve, tmp_path):
    manifest = RestorationPlan.uniform(5, "kept").save(tmp_path / "plan.json")
    with pytest.raises(ConfigError, match="restore_plan"):
        serve("qwen3", **RESTORE, restore_plan=str(manifest))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ConfigError, match="restore_plan"):
        serve("qwen3", **RESTORE, restore_plan=str(tmp_path / "broken.json"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plan_distilled_on_attention_serves_forks_and_comes_back_after_a_restart(
    serve, backend, verifier_pool, tmp_path
):
    """A plan whose f_θ was trained on its layer's attention output (`scripts/lib/distill.py`) is a plan like any
    other: it loads, serves evicting turns, forks into a session that continues as its parent does, and its
    sessions come back from the journal after a restart."""
    teacher = verifier_pool.for_backend("torch")["qwen3"]  # the queries come from a transformers forward
    texts = [_prompt(seed, 64) for seed in range(20, 36)]
    rows = kv_rows_by_layer(teacher, texts, range(3))
    # A strongly shrunk least-squares start, which the attention output tells distillation how to undo.
    plan, _ = fit_projections(plan_from_spec("tokens,kept,projected<-1", 3), rows, ridge=10.0)
    plan, report = distill_plan(teacher, plan, rows, texts, DistillSettings(sink=2, window=9, steps=200, lr=1e-3))
    assert report["L1->L2"]["distilled"] < report["L1->L2"]["least_squares"]  # trained, and better held out
    manifest = plan.save(tmp_path / "plan" / "restore_plan.json")
    state = str(tmp_path / "state")

    first = serve("qwen3", **RESTORE, restore_plan=str(manifest), state_dir=state)
    sid, tokens, truncated = _conversation(first, _prompt(5, 40))
    assert len(tokens) == 30 and truncated == []
    fork = first.stub.ForkSession(pb.ForkSessionRequest(session_id=sid)).session_id
    assert generate(first.stub, fork, max_tokens=8).tokens == generate(first.stub, sid, max_tokens=8).tokens
    before = info(first.stub, sid, tail=200)
    assert before.kv_restoration_state_bytes == before.evicted_token_count * 2 * 2 * 16 * 4  # the kept layer
    first.stop()

    second = serve("qwen3", **RESTORE, restore_plan=str(manifest), state_dir=state)
    after = info(second.stub, sid, tail=200)
    assert list(after.history_tail_token_ids) == list(before.history_tail_token_ids)
    assert info(second.stub, fork).history_length == before.history_length
    resumed = generate(second.stub, sid, max_tokens=6)
    assert len(resumed.tokens) == 6 and resumed.truncated == []
