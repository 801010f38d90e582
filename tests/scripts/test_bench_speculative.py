"""scripts/bench_speculative.py runs every arm side by side and writes the common results format."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.checkpoints import save_dflash_drafter, save_draft_model
from tests.support.children import run_child

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_compares_every_proposer_on_the_same_prompts(checkpoints, tmp_path):
    import numpy as np

    corpus = tmp_path / "corpus.npy"
    np.save(corpus, np.arange(200) % 120)
    command = [
        sys.executable,
        "scripts/bench_speculative.py",
        "--model",
        str(checkpoints["qwen3"]),
        "--dflash",
        str(save_dflash_drafter(tmp_path / "dflash")),
        "--draft-model",
        str(save_draft_model(tmp_path / "draft")),
        "--corpus",
        str(corpus),
        "--prompts",
        "2",
        "--prompt-tokens",
        "24",
        "--max-tokens",
        "12",
        "--repeats",
        "1",
        "--results-dir",
        str(tmp_path / "results"),
    ]
    result = run_child(command, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("bench_speculative_*.json")
    payload = json.loads(path.read_text())
    proposers = payload["summary"]["proposers"]
    speculative = ("ngram", "draft_model", "dflash")
    assert set(proposers) == {
        "none",
        *speculative,
        *(f"{name}/{p}" for name in speculative for p in ("adaptive", "cost")),
    }
    assert all(arm["identical_to_none"] for arm in proposers.values())
    assert all(proposers[name]["propose_ms"] > 0 and proposers[name]["verify_ms"] > 0 for name in speculative)
    assert payload["config"]["prompt_files"] == [str(corpus)]
    assert set(payload["summary"]["speedup_vs_none"]) == set(proposers)
    assert proposers["ngram"]["verifier_forwards_per_token"] < 1.0, "the prompt repeats: lookup drafts get accepted"
    assert path.with_suffix(".png").is_file()
    assert len(payload["samples"]["dflash"]) == 2


def test_draft_layers_cuts_the_verifier_into_a_draft_model(checkpoints, tmp_path):
    import numpy as np

    corpus = tmp_path / "corpus.npy"
    np.save(corpus, np.arange(100) % 60)
    common = [sys.executable, "scripts/bench_speculative.py", "--model", str(checkpoints["qwen3"])]
    small = ["--corpus", str(corpus), "--prompts", "1", "--prompt-tokens", "16", "--max-tokens", "8", "--repeats", "1"]
    small += ["--draft-policies", "full", "adaptive"]
    result = run_child([*common, *small, "--draft-layers", "1", "--results-dir", str(tmp_path / "results")], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("bench_speculative_*.json")
    proposers = json.loads(path.read_text())["summary"]["proposers"]
    assert set(proposers) == {"none", "ngram", "draft_model", "ngram/adaptive", "draft_model/adaptive"}
    assert proposers["draft_model"]["identical_to_none"] and proposers["draft_model"]["draft_acceptance_rate"] > 0
    too_deep = run_child([*common, *small, "--draft-layers", "9"], cwd=ROOT)
    assert too_deep.returncode != 0 and "--draft-layers must be in" in too_deep.stderr


def test_histories_run_every_arm_through_its_own_daemon_on_held_out_chat_prompts(tmp_path):
    """The bundled model ships a drafter and a chat template: a short rung of chat prompts and a document rung cut
    to its length, each arm's daemon started with its proposer and policy, every stream equal to none's."""
    results = tmp_path / "results"
    command = [sys.executable, "scripts/bench_speculative.py", "--histories", "64,300", "--prompts", "2"]
    command += ["--max-tokens", "12", "--repeats", "1", "--arms", "dflash,ngram/cost", "--rounds", "2"]
    command += ["--results-dir", str(results)]
    result = run_child(command, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = results.glob("bench_speculative_*.json")
    payload = json.loads(path.read_text())
    arms = payload["summary"]["arms"]
    assert list(arms) == ["none", "dflash", "ngram/cost"]
    assert payload["config"]["daemon_flags_by_arm"]["ngram/cost"][-4:] == [
        "--proposer",
        "ngram",
        "--draft-policy",
        "cost",
    ]
    for arm, rows in arms.items():
        assert list(rows) == ["64", "300"]
        assert all(row["identical_to_none"] and row["decode_tokens_per_s"] > 0 for row in rows.values()), arm
    assert arms["dflash"]["64"]["tokens_per_forward"] > 1.0 and arms["dflash"]["64"]["acceptance_rate"] > 0
    assert arms["none"]["300"]["drafted_per_token"] == 0
    # Two rounds, each in its own daemons: every row gives both rounds' ratios, none's own exactly 1.
    assert arms["none"]["64"]["speed_vs_none_by_round"] == [1.0, 1.0]
    assert all(len(row["speed_vs_none_by_round"]) == 2 for rows in arms.values() for row in rows.values())
    samples = payload["samples"]
    assert sorted({s["round"] for s in samples}) == [0, 1]
    short = [s["prompt_tokens"] for s in samples if s["history"] == 64]
    documents = [s["prompt_tokens"] for s in samples if s["history"] == 300]
    assert len(short) == len(documents) == 2 * 3 * 2
    assert max(short) <= 128 and all(250 <= n <= 330 for n in documents)
    assert path.with_suffix(".png").is_file()


def test_histories_refuse_unknown_arms_and_a_missing_drafter(checkpoints, tmp_path):
    base = [sys.executable, "scripts/bench_speculative.py", "--histories", "64", "--results-dir", str(tmp_path)]
    unknown = run_child([*base, "--arms", "none,medusa"], cwd=ROOT)
    assert unknown.returncode != 0 and "unknown proposers in --arms: medusa" in unknown.stderr
    policy = run_child([*base, "--arms", "ngram/cost,ngram/greedy,none/full"], cwd=ROOT)
    assert policy.returncode != 0 and "unknown draft policies in --arms: ngram/greedy, none/full" in policy.stderr
    missing = run_child([*base, "--model", str(checkpoints["qwen3"]), "--arms", "dflash"], cwd=ROOT)
    assert missing.returncode != 0 and "ships no DFlash drafter" in missing.stderr
    assert not list(tmp_path.glob("bench_speculative_*.json"))
