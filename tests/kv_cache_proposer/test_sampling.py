import math

import numpy as np
import pytest
import torch

from kv_cache_proposer import sampling
from kv_cache_proposer.backends.torch_backend.sampler import pick_tokens
from kv_cache_proposer.sampling import SamplingParams, position_uniform


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_k": -1},
        {"seed": -1},
        {"seed": 1 << 64},
    ],
)
def test_sampling_params_reject_out_of_range_values(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_position_uniform_is_a_deterministic_function_of_seed_and_position():
    draws = [position_uniform(7, p) for p in range(20000)]
    assert draws == [position_uniform(7, p) for p in range(20000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01
    assert draws[:50] != [position_uniform(8, p) for p in range(50)]


def test_greedy_picks_the_argmax_of_every_row():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, -1.0, 4.9]])
    assert pick_tokens(logits, SamplingParams(), [0, 1]) == [1, 0]


def test_top_k_one_is_greedy_and_top_k_limits_the_support():
    torch.manual_seed(0)
    logits = torch.randn(200, 16)
    params = SamplingParams(temperature=1.0, top_k=1, seed=3)
    assert pick_tokens(logits, params, range(200)) == logits.argmax(-1).tolist()
    picks = pick_tokens(logits, SamplingParams(temperature=1.0, top_k=3, seed=3), range(200))
    top3 = logits.topk(3, dim=-1).indices
    assert all(pick in top3[row].tolist() for row, pick in enumerate(picks))


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(500, 1)
    picks = pick_tokens(logits, SamplingParams(temperature=1.0, top_p=0.7, seed=11), range(500))
    assert set(picks) == {0, 1}


def test_sampled_frequencies_match_the_softmax_distribution():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    n = 30000
    logits = torch.log(probs).repeat(n, 1) * 2.0  # temperature 2 undoes the scaling
    picks = pick_tokens(logits, SamplingParams(temperature=2.0, seed=5), range(n))
    observed = torch.bincount(torch.tensor(picks), minlength=len(probs)).double()
    expected = probs.double() * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    # 5 degrees of freedom: P(chi2 > 20.5) ~ 0.001.
    assert chi2 < 20.5, (observed.tolist(), expected.tolist())


def test_the_shared_sampler_needs_one_position_per_logits_row():
    logits = np.zeros((3, 8))
    with pytest.raises(ValueError, match=r"shape \[2, vocab\]"):
        sampling.pick_tokens(logits, SamplingParams(temperature=1.0), [0, 1])
    assert sampling.pick_tokens(logits, SamplingParams(temperature=1.0, seed=2), [0, 1, 2]) == [
        sampling.pick_tokens(logits[i : i + 1], SamplingParams(temperature=1.0, seed=2), [i])[0] for i in range(3)
    ]
