"""Speculative decoding through the running server: every proposer and strategy gives exactly the tokens of
decoding without one, and speculation shows up in GenerateDone and /metrics."""

from __future__ import annotations

import random
import re

import pytest

from inference_engine.generated import runtime_pb2 as pb
from tests.support.checkpoints import VOCAB_SIZE
from tests.support.server import create, generate, info

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

STRATEGIES = {
    "full": {"kv_strategy": "full"},
    "sink_window": {"kv_strategy": "sink_window", "sink": 2, "window": 9},
    "dlm_restore": {"kv_strategy": "dlm_restore", "sink": 2, "window": 9},
}


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB_SIZE - 1) for _ in range(n)] for n in (5, 17, 30)]
    motif = [rng.randrange(VOCAB_SIZE - 1) for _ in range(6)]
    prompts.append(motif * 5)  # repeated spans, where prompt lookup drafts well
    return prompts


def _conversation(server, prompt: list[int], sampling: dict) -> tuple[list[int], list[pb.GenerateDone]]:
    """Three turns on one session: the prompt, then two appended follow-ups; returns the tokens and dones."""
    sid = create(server.stub, initial=prompt)
    tokens, dones = [], []
    for turn in range(3):
        if turn:
            server.stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=prompt[:4]))
        result = generate(server.stub, sid, max_tokens=14, **sampling)
        tokens += result.tokens
        dones.append(result.done)
    return tokens, dones


@pytest.fixture(scope="module")
def proposer_settings(checkpoints, tmp_path_factory):
    from tests.support.checkpoints import save_dflash_drafter, save_draft_model

    root = tmp_path_factory.mktemp("proposers")
    return {
        "ngram": {"proposer": "ngram", "num_draft_tokens": 5, "ngram_max_n": 3},  # under the default policy, cost
        "ngram_full": {"proposer": "ngram", "num_draft_tokens": 5, "ngram_max_n": 3, "draft_policy": "full"},
        "draft_model": {"proposer": "draft_model", "draft_model": str(save_draft_model(root / "draft"))},
        "draft_model_self": {"proposer": "draft_model", "draft_model": str(checkpoints["qwen3"])},
        "dflash": {"proposer": "dflash", "draft_model": str(save_dflash_drafter(root / "dflash"))},
    }


CASES = [
    *[
        ("torch", p, s, {})
        for p in ("ngram", "ngram_full", "draft_model", "draft_model_self", "dflash")
        for s in STRATEGIES
    ],
    *[("torch", p, "full", {"temperature": 0.8, "seed": 21}) for p in ("ngram", "draft_model_self", "dflash")],
    *[("mlx", p, s, {}) for p in ("ngram", "ngram_full", "draft_model", "dflash") for s in STRATEGIES],
]


@pytest.mark.parametrize(
    ("backend", "proposer", "strategy", "sampling"), CASES, ids=[f"{b}-{p}-{s}-{bool(t)}" for b, p, s, t in CASES]
)
def test_each_proposer_streams_exactly_the_tokens_of_plain_decoding(
    serve, proposer_settings, backend, proposer, strategy, sampling
):
    plain = serve("qwen3", **STRATEGIES[strategy])
    speculative = serve("qwen3", **STRATEGIES[strategy], **proposer_settings[proposer])
    drafted = accepted = 0
    for prompt in _prompts():
        expected, _ = _conversation(plain, prompt, sampling)
        tokens, dones = _conversation(speculative, prompt, sampling)
        assert tokens == expected
        drafted += sum(d.draft_token_count for d in dones)
        accepted += sum(d.accepted_draft_token_count for d in dones)
    assert drafted > 0
    if proposer in ("draft_model_self", "ngram_full") and not sampling:
        assert accepted > 0, "a proposer that can predict the verifier must get drafts accepted"


def test_speculation_is_counted_in_generate_done_and_metrics(serve, proposer_settings):
    server = serve("qwen3", **proposer_settings["draft_model_self"])
    sid = create(server.stub, initial=_prompts()[1])
    done = generate(server.stub, sid, max_tokens=30).done
    assert done.generated_token_count == 30
    assert done.accepted_draft_token_count > 0 and done.draft_token_count >= done.accepted_draft_token_count
    # One forward for the prompt, then every forward emits its accepted drafts plus one token.
    assert done.verifier_forward_count == 30 - done.accepted_draft_token_count
    text = server.metrics_text()

    def value(name: str) -> float:
        match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        assert match, name
        return float(match.group(1))

    assert value("kakeya_speculative_draft_tokens_total") == done.draft_token_count
    assert value("kakeya_speculative_accepted_tokens_total") == done.accepted_draft_token_count
    assert value("kakeya_verifier_forwards_total") == done.verifier_forward_count
    assert value("kakeya_generate_verifier_forwards_per_token_count") == 1
    assert value("kakeya_speculative_acceptance_length_count") == value("kakeya_speculative_drafts_total") > 0


def test_the_cost_policy_counts_its_decisions_in_metrics(serve, proposer_settings):
    server = serve("qwen3", **proposer_settings["ngram"], draft_policy="cost")
    sid = create(server.stub, initial=_prompts()[3])
    generate(server.stub, sid, max_tokens=20)
    text = server.metrics_text()

    def value(name: str) -> float:
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert match, name
        return float(match.group(1))

    decisions = {
        d: value(f'kakeya_speculative_decisions_total{{decision="{d}"}}') for d in ("draft", "decline", "probe")
    }
    assert decisions["probe"] >= 1  # a session's first steps measure drafting and plain steps
    assert 0 < value("kakeya_speculative_drafts_total") <= decisions["draft"] + decisions["probe"]


@pytest.mark.parametrize("proposer", ["none", "ngram", "draft_model", "dflash"])
def test_session_info_reports_the_proposer_s_state_as_part_of_the_session_s_bytes(serve, proposer_settings, proposer):
    server = serve("qwen3", **proposer_settings.get(proposer, {"proposer": "none"}))
    sid = create(server.stub, initial=_prompts()[3])
    generate(server.stub, sid, max_tokens=8)
    before = info(server.stub, sid)
    # A full session holds its resident K/V and its proposer's state, nothing else.
    assert before.kv_live_bytes == before.kv_resident_bytes + before.draft_state_bytes
    if proposer == "none":
        assert before.draft_state_bytes == 0
        return
    assert before.draft_state_bytes > 0
    # Enough positions to outgrow any block a cache reserves ahead.
    server.stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=_prompts()[2] * 10))
    generate(server.stub, sid, max_tokens=8)
    after = info(server.stub, sid)
    assert after.draft_state_bytes > before.draft_state_bytes  # it grows with the history it drafts from
    assert f"kakeya_draft_state_bytes {float(after.draft_state_bytes)}" in server.metrics_text().splitlines()
