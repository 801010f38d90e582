"""Token choice from logits rows on the PyTorch backend (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kv_cache_proposer.sampling import SamplingParams, position_uniform


def pick_tokens(logits: torch.Tensor, params: SamplingParams, positions: Sequence[int]) -> list[int]:
    """One token per row of `logits` [rows, vocab]; row i draws with the uniform of `positions[i]`."""
    if params.greedy:
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
    scaled = logits.double() / params.temperature  # [rows, V]
    # Stable descending sort: ties keep vocabulary order, so the inverse-CDF draw is well defined.
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    if params.top_k:
        sorted_logits[:, params.top_k :] = float("-inf")
    probs = torch.softmax(sorted_logits, dim=-1)
    if params.top_p < 1.0:
        mass_before = torch.cumsum(probs, dim=-1) - probs
        probs = torch.where(mass_before < params.top_p, probs, torch.zeros_like(probs))
    cdf = torch.cumsum(probs, dim=-1)  # [rows, V]
    uniforms = torch.tensor([position_uniform(params.seed, p) for p in positions], dtype=cdf.dtype, device=cdf.device)
    targets = uniforms * cdf[:, -1]
    picks = torch.searchsorted(cdf, targets[:, None], right=True).clamp_(max=cdf.shape[-1] - 1)
    return [int(t) for t in order.gather(-1, picks).flatten().tolist()]
