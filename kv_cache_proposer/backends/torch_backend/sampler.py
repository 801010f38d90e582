"""Token choice from logits rows on the PyTorch backend: greedy on the device, sampling through the shared
float64 host implementation so both backends draw the same token from the same logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kv_cache_proposer import sampling
from kv_cache_proposer.sampling import SamplingParams


def pick_tokens(logits: torch.Tensor, params: SamplingParams, positions: Sequence[int]) -> list[int]:
    """One token per row of `logits` [rows, vocab]; row i draws with the uniform of `positions[i]`."""
    if params.greedy:
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
    return sampling.pick_tokens(logits.double().cpu().numpy(), params, positions)
