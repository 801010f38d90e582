"""Speculative sampling is lossless: with drafts accepted only when they equal the verifier's own sample, the
sampled tokens follow the distribution of sampling from the verifier alone (chi-square against the exact
marginals of non-speculative sampling, computed by enumeration on a 16-token vocabulary; fixed seeds)."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.proposers import ProposerOptions, load_proposer
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy

VOCAB = 16
SAMPLES = 400
TOKENS = 3
TEMPERATURE = 1.0
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory) -> Path:
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        initializer_range=0.15,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(3)
    directory = tmp_path_factory.mktemp("vocab16") / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def verifier(small_vocab_model) -> TorchVerifier:
    return TorchVerifier.load(small_vocab_model, device="cpu", dtype="float32")


def exact_marginals(verifier: TorchVerifier, temperature: float) -> list[torch.Tensor]:
    """The distribution of each of the first TOKENS sampled tokens under plain sampling [VOCAB] each, by
    enumerating every earlier continuation in one batched forward per position."""
    marginals, joint = [], torch.ones(1, dtype=torch.float64)  # joint[i]: probability of continuation i
    for length in range(TOKENS):
        continuations = list(itertools.product(range(VOCAB), repeat=length))
        batch = torch.tensor([PROMPT + list(c) for c in continuations])
        with torch.no_grad():
            logits = verifier.model(input_ids=batch).logits[:, -1].double()  # [VOCAB**length, VOCAB]
        step = torch.softmax(logits / temperature, dim=-1)
        marginals.append((joint[:, None] * step).sum(0))
        joint = (joint[:, None] * step).reshape(-1)
    return marginals


def _speculative_samples(verifier: TorchVerifier, options: ProposerOptions) -> list[list[int]]:
    proposer = load_proposer(options, verifier, backend="torch")
    decoder = Decoder(verifier)
    runs = []
    for seed in range(SAMPLES):
        seq = SequenceState(
            cache=verifier.new_cache(FullStrategy()), tokens=list(PROMPT), draft_session=proposer.open(FullStrategy())
        )
        produced: list[int] = []
        while len(produced) < TOKENS:
            params = SamplingParams(temperature=TEMPERATURE, seed=seed)
            produced += decoder.step(seq, params, GenerationBudget(TOKENS), len(produced)).tokens
        seq.draft_session.release()
        runs.append(produced)
    return runs


def goodness_of_fit(counts: Counter[int], probs: torch.Tensor) -> tuple[float, int]:
    """Chi-square statistic of observed counts against probabilities, bins with expectation < 5 pooled."""
    total = sum(counts.values())
    cells, pooled = [], [0.0, 0.0]
    for token in range(len(probs)):
        expected = float(probs[token]) * total
        if expected >= 5:
            cells.append((counts[token], expected))
        else:
            pooled[0] += counts[token]
            pooled[1] += expected
    if pooled[1] > 0:
        cells.append((pooled[0], pooled[1]))
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


def critical_value(df: int, z: float = 3.09) -> float:
    """Chi-square quantile at p = 0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_the_test_rejects_a_different_distribution_at_this_sample_size(verifier):
    exact = exact_marginals(verifier, TEMPERATURE)
    colder = exact_marginals(verifier, 0.6)
    generator = torch.Generator().manual_seed(0)
    for position in range(TOKENS):
        draws = torch.multinomial(colder[position].float(), SAMPLES, replacement=True, generator=generator)
        chi2, df = goodness_of_fit(Counter(draws.tolist()), exact[position])
        assert chi2 > critical_value(df), (position, chi2, df)


@pytest.mark.parametrize("proposer_name", ["draft_model"])
def test_speculative_samples_follow_the_verifiers_own_distribution(small_vocab_model, verifier, proposer_name):
    options = ProposerOptions(name=proposer_name, draft_model=small_vocab_model, num_draft_tokens=3, ngram_max_n=2)
    runs = _speculative_samples(verifier, options)
    exact = exact_marginals(verifier, TEMPERATURE)
    for position in range(TOKENS):
        chi2, df = goodness_of_fit(Counter(run[position] for run in runs), exact[position])
        assert chi2 < critical_value(df), (position, chi2, df)
