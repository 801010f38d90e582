"""Sampling parameters, the per-position random draws that make sampling reproducible, and the token choice.

A sampled token at global position p uses the uniform draw `position_uniform(seed, p)`. The draw does not depend
on how many tokens were decoded per forward, so speculative decoding that accepts a draft only when it equals the
verifier's own sample yields exactly the tokens non-speculative sampling would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to turn logits into a token. `temperature == 0` is greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.seed <= _MASK64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_uniform(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) determined by (seed, position) alone."""
    bits = _splitmix64(_splitmix64(seed) ^ (position & _MASK64))
    return (bits >> 11) * (1.0 / (1 << 53))


def pick_tokens(logits: np.ndarray, params: SamplingParams, positions: Sequence[int]) -> list[int]:
    """One token per row of `logits` [rows, vocab]; row i draws with the uniform of `positions[i]`.

    Every backend samples through this one function on float64 host copies of its logits, so the same logits,
    seed and position give the same token on every backend.
    """
    if logits.ndim != 2 or logits.shape[0] != len(positions):
        raise ValueError(f"expected logits of shape [{len(positions)}, vocab], got {list(logits.shape)}")
    if params.greedy:
        return [int(t) for t in logits.argmax(axis=-1)]
    order, probs = _filtered_sorted_probs(logits, params)
    cdf = np.cumsum(probs, axis=-1)  # [rows, V]
    uniforms = np.array([position_uniform(params.seed, p) for p in positions], dtype=np.float64)
    targets = uniforms * cdf[:, -1]
    # Inverse CDF: the first sorted index whose cumulative mass exceeds the target.
    picks = np.minimum((cdf <= targets[:, None]).sum(axis=-1), cdf.shape[-1] - 1)  # [rows]
    return [int(t) for t in np.take_along_axis(order, picks[:, None], axis=-1)[:, 0]]


def log_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Log-probabilities [rows, vocab] of the distribution each row's token is drawn from.

    Sampling: the logits divided by the temperature, restricted by top-k, top-p and min-p and renormalised
    (tokens outside the kept set get -inf). Greedy decoding has no sampling transforms: the softmax of the logits.
    """
    if params.greedy:
        shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    order, probs = _filtered_sorted_probs(logits, params)
    with np.errstate(divide="ignore"):
        sorted_log = np.log(probs / probs.sum(axis=-1, keepdims=True))  # [rows, V]
    out = np.empty_like(sorted_log)
    np.put_along_axis(out, order, sorted_log, axis=-1)
    return out


def _filtered_sorted_probs(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Vocabulary order by descending scaled logit and the kept (unnormalised) probabilities in that order."""
    scaled = logits.astype(np.float64) / params.temperature  # [rows, V]
    # Stable descending order: ties keep vocabulary order, so the inverse-CDF draw is well defined.
    order = np.argsort(-scaled, axis=-1, kind="stable")  # [rows, V]
    sorted_logits = np.take_along_axis(scaled, order, axis=-1)
    if params.top_k:
        sorted_logits[:, params.top_k :] = -np.inf
    shifted = np.exp(sorted_logits - sorted_logits[:, :1])
    probs = shifted / shifted.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        mass_before = np.cumsum(probs, axis=-1) - probs
        probs = np.where(mass_before < params.top_p, probs, 0.0)
    if params.min_p > 0.0:
        # Relative to the most likely token, which is always kept; the ratio does not depend on normalisation.
        probs = np.where(probs >= params.min_p * probs[:, :1], probs, 0.0)
    return order, probs
