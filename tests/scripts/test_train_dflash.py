"""scripts/train_dflash.py end to end on a tiny verifier: published format out, acceptance above 1, resumable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

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
        "--self-generate",
        "3000",
        "--steps",
        str(steps),
        "--batch-size",
        "4",
        "--seq-len",
        "96",
        "--anchors",
        "8",
        "--block-size",
        "4",
        "--mask-token-id",
        "127",
        "--lr",
        "2e-3",
        "--eval-prompts",
        "4",
        "--eval-prompt-len",
        "24",
        "--eval-tokens",
        "40",
        "--save-every",
        "50",
        *extra,
    ]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_a_trained_drafter_is_accepted_by_its_verifier_and_training_resumes(checkpoints, tmp_path):
    out, results = tmp_path / "drafter", tmp_path / "results"
    first = _train(checkpoints["llama"], out, results, 120)
    assert first.returncode == 0, first.stderr[-3000:]
    names = set(load_file(out / "model.safetensors"))
    assert "fc.weight" in names and "hidden_norm.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    log = json.loads((out / "training_log.json").read_text())
    assert log["summary"]["mean_acceptance_length"] > 1.0, log["summary"]
    assert len(log["history"]) == 120 and log["history"][-1]["loss"] < log["history"][0]["loss"]
    (result_file,) = results.glob("train_dflash_*.json")
    assert json.loads(result_file.read_text())["summary"]["mean_acceptance_length"] > 1.0
    assert result_file.with_suffix(".png").is_file()

    resumed = _train(checkpoints["llama"], out, results, 130, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    history = json.loads((out / "training_log.json").read_text())["history"]
    assert [h["step"] for h in history] == list(range(1, 131)), "the resumed run continues at step 121"
    assert history[:120] == log["history"]


def test_self_generated_rows_continue_the_prompt_corpus_and_evaluation_reads_its_own_corpus(checkpoints, tmp_path):
    rng = np.random.default_rng(7)
    prompt_corpus, eval_corpus = tmp_path / "prompts.npy", tmp_path / "held.npy"
    np.save(prompt_corpus, rng.integers(0, 120, 400))
    np.save(eval_corpus, rng.integers(0, 120, 20))
    out = tmp_path / "drafter"
    common = ["--prompt-corpus", str(prompt_corpus), "--generate-prompt-len", "20", "--generate-new-tokens", "28"]

    short = _train(checkpoints["llama"], out, tmp_path / "results", 2, *common, "--eval-corpus", str(eval_corpus))
    assert short.returncode != 0
    assert "the evaluation text holds 20 tokens, fewer than --eval-prompt-len 24" in short.stderr
    corpus = np.load(out / "corpus.npy")
    seeds = np.load(prompt_corpus)
    windows = {tuple(seeds[i : i + 20]) for i in range(len(seeds) - 20)}
    rows = corpus[: len(corpus) // 48 * 48].reshape(-1, 48)
    assert len(corpus) == 3000 and all(tuple(row[:20]) in windows for row in rows), "each row opens with a slice"

    np.save(eval_corpus, rng.integers(0, 120, 200))
    done = _train(checkpoints["llama"], out, tmp_path / "results", 2, *common, "--eval-corpus", str(eval_corpus))
    assert done.returncode == 0, done.stderr[-3000:]
    log = json.loads((out / "training_log.json").read_text())
    assert log["config"]["eval_corpus"] == str(eval_corpus) and log["summary"]["drafting_steps"] > 0


def test_a_prompt_corpus_shorter_than_a_prompt_is_refused(checkpoints, tmp_path):
    prompt_corpus = tmp_path / "prompts.npy"
    np.save(prompt_corpus, np.arange(10))
    run = _train(
        checkpoints["llama"], tmp_path / "drafter", tmp_path / "results", 2, "--prompt-corpus", str(prompt_corpus)
    )
    assert run.returncode != 0 and "--prompt-corpus holds 10 tokens" in run.stderr
