"""scripts/train_dflash.py end to end on a tiny verifier: published format out, held-out acceptance logged,
rows that are the verifier's own continuations, resumable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.support.children import run_child

pytestmark = pytest.mark.slow  # left out of the fast subset (`pytest -m "not slow"`)

ROOT = Path(__file__).resolve().parents[2]


def _train(checkpoint: Path, out: Path, results: Path, steps: int, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "scripts/train_dflash.py",
        "--model",
        str(checkpoint),
        "--out",
        str(out),
        "--results-dir",
        str(results),
        "--steps",
        str(steps),
        "--batch-size",
        "4",
        "--row-len",
        "64",
        "--prompt-lens",
        "8",
        "24",
        "--anchors",
        "8",
        "--block-size",
        "4",
        "--mask-token-id",
        "127",
        "--lr",
        "2e-3",
        "--eval-rows",
        "2",
        "--eval-every",
        "40",
        "--eval-prompts",
        "3",
        "--eval-prompt-len",
        "16",
        "--eval-tokens",
        "24",
        "--save-every",
        "50",
        *extra,
    ]
    return run_child(command, cwd=ROOT)


def _corpora(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(7)
    prompts, held = tmp_path / "prompts.npy", tmp_path / "held.npy"
    np.save(prompts, rng.integers(0, 120, 600))
    np.save(held, rng.integers(0, 120, 200))
    return prompts, held


def test_a_trained_drafter_is_accepted_by_its_verifier_and_training_resumes(checkpoints, tmp_path):
    prompts, held = _corpora(tmp_path)
    out, results = tmp_path / "drafter", tmp_path / "results"
    common = ["--continuations", "24", "--prompt-corpus", str(prompts), "--eval-corpus", str(held)]
    first = _train(checkpoints["llama"], out, results, 120, *common)
    assert first.returncode == 0, first.stderr[-3000:]
    names = set(load_file(out / "model.safetensors"))
    assert "fc.weight" in names and "hidden_norm.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    log = json.loads((out / "training_log.json").read_text())
    assert log["summary"]["mean_acceptance_length"] > 1.0, log["summary"]
    assert len(log["history"]) == 120 and log["history"][-1]["loss"] < log["history"][0]["loss"]
    curve = [h["heldout_acceptance_length"] for h in log["history"] if "heldout_acceptance_length" in h]
    assert len(curve) == 3 and all(1.0 <= a <= 4.0 for a in curve), "held-out acceptance at steps 40, 80, 120"
    best = max(curve)
    assert log["summary"]["kept_heldout_acceptance_length"] == best
    assert log["summary"]["kept_step"] == 40 * (curve.index(best) + 1), "the drafter written is the best measured"
    assert log["config"]["command"].startswith("train_dflash.py --model") and "environment" in log
    (result_file,) = results.glob("train_dflash_*.json")
    assert json.loads(result_file.read_text())["summary"]["mean_acceptance_length"] > 1.0
    assert result_file.with_suffix(".png").is_file()

    resumed = _train(checkpoints["llama"], out, results, 130, *common, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    history = json.loads((out / "training_log.json").read_text())["history"]
    assert [h["step"] for h in history] == list(range(1, 131)), "the resumed run continues at step 121"
    assert history[:120] == log["history"]


def test_rows_are_the_verifiers_greedy_continuations_of_prompt_slices(checkpoints, tmp_path):
    prompts, held = _corpora(tmp_path)
    out = tmp_path / "drafter"
    run = _train(
        checkpoints["llama"],
        out,
        tmp_path / "results",
        2,
        "--continuations",
        "6",
        "--prompt-corpus",
        str(prompts),
        "--eval-corpus",
        str(held),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = np.load(out / "rows.npz")
    tokens, first = rows["train"].astype(np.int64), rows["train_first"]
    assert tokens.shape == (6, 64) and all(8 <= f <= 24 for f in first)
    seeds = np.load(prompts)
    model = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], local_files_only=True)
    for row, prompt_len in zip(tokens, first, strict=True):
        windows = {tuple(seeds[i : i + prompt_len]) for i in range(len(seeds) - prompt_len)}
        assert tuple(row[:prompt_len]) in windows, "each row opens with a slice of the prompt corpus"
        with torch.no_grad():
            logits = model(torch.tensor(row[None])).logits[0]
        # Every continuation token is the verifier's greedy choice given everything before it.
        predicted = logits[prompt_len - 1 : -1].argmax(-1).numpy()
        assert (predicted == row[prompt_len:]).mean() > 0.95
    assert rows["held"].shape[1] == 16 + 24 and (rows["held_first"] == 16).all()


def test_bad_corpora_and_lengths_are_refused(checkpoints, tmp_path):
    prompts, held = _corpora(tmp_path)
    short = tmp_path / "short.npy"
    np.save(short, np.arange(10))
    run = _train(
        checkpoints["llama"],
        tmp_path / "a",
        tmp_path / "r",
        2,
        "--continuations",
        "4",
        "--prompt-corpus",
        str(prompts),
        "--eval-corpus",
        str(short),
    )
    assert run.returncode != 0 and "the evaluation text holds 10 tokens, fewer than --eval-prompt-len 16" in run.stderr
    run = _train(
        checkpoints["llama"],
        tmp_path / "b",
        tmp_path / "r",
        2,
        "--continuations",
        "4",
        "--prompt-corpus",
        str(short),
        "--eval-corpus",
        str(held),
    )
    assert run.returncode != 0 and "the prompt text holds 10 tokens" in run.stderr
    run = _train(checkpoints["llama"], tmp_path / "c", tmp_path / "r", 2, "--prompt-lens", "8", "62")
    assert run.returncode != 0 and "MAX + --block-size <= --row-len" in run.stderr


def test_a_prompt_file_trains_on_ragged_continuations_under_drawn_windows_and_measures_each(checkpoints, tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    from lib.prompt_rows import PromptSet

    rng = np.random.default_rng(3)
    train = [rng.integers(0, 120, int(n)).tolist() for n in rng.integers(6, 40, 10)]
    held = [rng.integers(0, 120, int(n)).tolist() for n in (8, 30)]
    prompts = tmp_path / "prompts.npz"
    PromptSet(train, ["slice"] * 10, held, ["slice"] * 2).save(prompts)
    out, results = tmp_path / "drafter", tmp_path / "results"
    command = [
        sys.executable,
        "scripts/train_dflash.py",
        "--model",
        str(checkpoints["llama"]),
        "--out",
        str(out),
        "--results-dir",
        str(results),
        "--prompts",
        str(prompts),
        "--new-tokens",
        "7",
        "--batch-tokens",
        "96",
        "--steps",
        "4",
        "--anchors",
        "3",
        "--block-size",
        "4",
        "--mask-token-id",
        "127",
        "--sliding-window",
        "8",
        "--train-windows",
        "4",
        "0",
        "--eval-rows",
        "2",
        "--eval-prompts",
        "1",
        "--eval-tokens",
        "6",
    ]
    run = run_child(command, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = np.load(out / "rows.npz")
    tokens, first, lengths = rows["train"].astype(np.int64), rows["train_first"], rows["train_lengths"]
    assert sorted(first.tolist()) == sorted(len(p) for p in train) and len(set(lengths.tolist())) > 1
    model = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], local_files_only=True)
    for row, prompt_len, length in zip(tokens, first, lengths, strict=True):
        assert any(row[:prompt_len].tolist() == p for p in train), "each row opens with one of the prompts"
        assert prompt_len < length <= prompt_len + 7 and not row[length:].any(), "then at most 7 tokens, padded"
        with torch.no_grad():
            logits = model(torch.tensor(row[None, :length])).logits[0]
        predicted = logits[prompt_len - 1 : length - 1].argmax(-1).numpy()
        assert (predicted == row[prompt_len:length]).mean() > 0.9, "the verifier's greedy continuation"
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] and config["sliding_window"] == 8
    log = json.loads((out / "training_log.json").read_text())
    assert set(log["summary"]["heldout_acceptance_by_window"]) == {"0", "4"}
    assert {r["prompt_tokens"] for r in log["acceptance_by_window"]} <= {8, 30}

    windows = run_child(
        [
            sys.executable,
            "scripts/bench_drafter_windows.py",
            "--model",
            str(checkpoints["llama"]),
            "--prompts",
            str(prompts),
            "--drafters",
            str(out),
            "--windows",
            "0",
            "4",
            "--new-tokens",
            "6",
            "--results-dir",
            str(results),
        ],
        cwd=ROOT,
    )
    assert windows.returncode == 0, windows.stderr[-3000:]
    (measured,) = results.glob("bench_drafter_windows_*.json")
    summary = json.loads(measured.read_text())["summary"][str(out)]
    assert set(summary) == {"0", "4"} and all(1.0 <= summary[w]["mean"] <= 4.0 for w in summary)


def test_a_generation_time_bound_keeps_whole_chunks_of_prompts_drawn_across_lengths(checkpoints, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    from lib import prompt_rows
    from lib.drafter_rows import Rows

    from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier

    verifier = TorchVerifier.load(checkpoints["llama"], device="cpu", dtype="float32")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 120, n).tolist() for n in range(4, 16)]  # prompt i holds i + 4 tokens

    def rows(chosen: list[list[int]], desc: str) -> Rows:
        return prompt_rows.prompt_continuations(
            verifier, chosen, new_tokens=5, stop_ids=[], token_budget=400, max_rows=8, desc=desc, bf16=True
        )

    monkeypatch.setattr(prompt_rows, "GENERATE_CHUNK", 4)
    everything = prompt_rows.rows_within(0, prompts, rows, seed=1)
    assert sorted(everything.first_anchor.tolist()) == list(range(4, 16)), "no bound: every prompt"
    assert (everything.row_lengths() == everything.first_anchor + 5).all()
    cut = prompt_rows.rows_within(1e-9, prompts, rows, seed=1)
    assert len(cut) == 4, "past the bound after the first chunk: that chunk alone"
    assert sorted(cut.first_anchor.tolist()) != [4, 5, 6, 7], "drawn in a random order, not the shortest first"
    for row, first in zip(cut.tokens, cut.first_anchor, strict=True):
        assert row[:first].tolist() == prompts[first - 4]
