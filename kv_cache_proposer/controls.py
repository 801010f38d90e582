"""Per-generation controls of the decode step: penalties, a grammar, stop sequences and log-probabilities.

They act on host float64 copies of the verifier's logits, in this order for every block row: penalties over the
history window the row continues, then the grammar mask of the grammar state the row continues, then the sampling
transforms of `sampling.py`. Row i of a speculative block continues `history + draft[:i]`, so when the drafts are
accepted it sees exactly the history non-speculative decoding would have: the output (greedy) and the seeded draws
(sampling) are the same with and without speculation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

import kv_cache_proposer.sampling as sampling
from kv_cache_proposer.grammar import GrammarState
from kv_cache_proposer.sampling import SamplingParams

DEFAULT_PENALTY_WINDOW_TOKENS = 64


@dataclass(frozen=True, slots=True)
class Penalties:
    """Repetition, presence and frequency penalties over the last `window_tokens` tokens of the history.

    For a token seen c > 0 times in the window: a repetition penalty r divides its logit by r when positive and
    multiplies it by r otherwise (CTRL), then `frequency * c + presence` is subtracted from it.
    """

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    window_tokens: int = DEFAULT_PENALTY_WINDOW_TOKENS

    def __post_init__(self) -> None:
        if not (np.isfinite(self.repetition) and self.repetition > 0):
            raise ValueError(f"repetition penalty must be finite and > 0, got {self.repetition}")
        for name in ("presence", "frequency"):
            if not np.isfinite(getattr(self, name)):
                raise ValueError(f"{name} penalty must be finite, got {getattr(self, name)}")
        if self.window_tokens < 1:
            raise ValueError(f"penalty window must be >= 1 token, got {self.window_tokens}")

    @property
    def active(self) -> bool:
        return self.repetition != 1.0 or self.presence != 0.0 or self.frequency != 0.0

    def apply(self, logits: np.ndarray, history: Sequence[int]) -> None:
        """Penalise one row of logits [vocab] in place for the tokens of `history`'s window."""
        counts = Counter(history[-self.window_tokens :])
        if not counts:
            return
        ids = np.fromiter(counts.keys(), dtype=np.int64)
        seen = np.fromiter(counts.values(), dtype=np.float64)
        values = logits[ids]
        if self.repetition != 1.0:
            values = np.where(values > 0, values / self.repetition, values * self.repetition)
        logits[ids] = values - self.frequency * seen - self.presence


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class DecodeControls:
    """The controls of one generation. `grammar` is its own state (it follows the committed tokens)."""

    grammar: GrammarState | None = None
    penalties: Penalties = field(default_factory=Penalties)
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    # None: no log-probabilities; N >= 0: the chosen token's and the N most likely alternatives.
    top_logprobs: int | None = None

    def __post_init__(self) -> None:
        if any(not s for s in self.stop_sequences):
            raise ValueError("a stop sequence must hold at least one token")

    @property
    def transforms_logits(self) -> bool:
        """Whether token choice needs the host pipeline (otherwise the backend's own `pick_tokens` suffices)."""
        return self.grammar is not None or self.penalties.active or self.top_logprobs is not None


@dataclass(frozen=True, slots=True)
class Picks:
    """Tokens chosen for the rows of a block, their log-probabilities when asked, and the first row where the
    grammar allowed no token (None when every row had one)."""

    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None
    dead_end_row: int | None = None


def pick_controlled(
    logits: np.ndarray,
    params: SamplingParams,
    positions: Sequence[int],
    controls: DecodeControls,
    history: Sequence[int],
    draft: Sequence[int],
) -> Picks:
    """Choose a token for every row of `logits` [len(draft) + 1, vocab] (float64, host), row i continuing
    `history + draft[:i]`. The draft must already be cut to what the grammar accepts."""
    rows = logits.astype(np.float64, copy=True)  # [rows, V]
    if controls.penalties.active:
        for i in range(rows.shape[0]):
            controls.penalties.apply(rows[i], [*history, *draft[:i]])
    dead_end_row = None
    if controls.grammar is not None:
        allowed = controls.grammar.masks_along(draft)  # [rows, V]
        rows = np.where(allowed, rows, -np.inf)
        empty = ~allowed.any(axis=-1)
        if empty.any():
            dead_end_row = int(np.argmax(empty))
            # Rows from a dead end on are never emitted; give them finite logits so the draws stay defined.
            rows[dead_end_row:] = 0.0
    tokens = sampling.pick_tokens(rows, params, positions)
    logprobs = None
    if controls.top_logprobs is not None:
        logprobs = _logprobs(sampling.log_probs(rows, params), tokens, controls.top_logprobs)
    return Picks(tokens, logprobs, dead_end_row)


def match_stop_sequence(output: Sequence[int], stop_sequences: Sequence[Sequence[int]]) -> int | None:
    """Index of the first stop sequence that `output` ends with, or None."""
    for index, stop in enumerate(stop_sequences):
        n = len(stop)
        if len(output) >= n and list(output[-n:]) == list(stop):
            return index
    return None


def _logprobs(table: np.ndarray, tokens: Sequence[int], top_n: int) -> list[TokenLogprob]:
    out = []
    for row, token in zip(table, tokens, strict=True):
        top: tuple[tuple[int, float], ...] = ()
        if top_n:
            # Stable order: ties keep vocabulary order, like the sampler.
            best = np.argsort(-row, kind="stable")[:top_n]
            top = tuple((int(t), float(row[t])) for t in best if np.isfinite(row[t]))
        out.append(TokenLogprob(int(token), float(row[token]), top))
    return out
