"""A session's token history bound to its caches, and what one decode step is asked and returns (`decoding.py`
runs the step).

A history is `committed tokens + pending tokens`: committed tokens have resident K/V in the verifier cache, pending
ones are processed by the next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from kv_cache_proposer.cache import SessionCache
from kv_cache_proposer.controls import DecodeControls, TokenLogprob, match_stop_sequence
from kv_cache_proposer.proposers.base import DraftSession, NoDraftSession
from kv_cache_proposer.proposers.cost_model import DraftCostModel, DraftDecision
from kv_cache_proposer.sampling import SamplingParams


class StopCause(Enum):
    EOS = "eos"
    MAX_TOKENS = "max_tokens"
    HISTORY_LIMIT = "history_limit"
    STOP_SEQUENCE = "stop_sequence"
    GRAMMAR_DEAD_END = "grammar_dead_end"


@dataclass(slots=True)
class DraftLength:
    """How many tokens the next proposal may hold: grows while drafts are fully accepted, shrinks (down to one)
    when they are not."""

    limit: int
    current: int = -1

    def __post_init__(self) -> None:
        if self.current < 0:
            self.current = self.limit

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.current = min(self.limit, self.current + 2)
        else:
            self.current = max(1, self.current - 1)


@dataclass(slots=True)
class SequenceState:
    """One session's token history bound to its verifier cache and its drafting state.

    `committed` is the sequence's own record of how many positions the cache holds; every commit is checked
    against the cache (INV-1) and must never move it backwards (INV-2).
    """

    cache: SessionCache[Any]
    tokens: list[int] = field(default_factory=list)
    draft_session: DraftSession = field(default_factory=NoDraftSession)
    committed: int = 0
    draft_length: DraftLength = field(init=False)
    draft_costs: DraftCostModel = field(init=False)  # what drafting costs and yields, for the `cost` policy

    def __post_init__(self) -> None:
        self.draft_length = DraftLength(self.draft_session.max_draft_tokens)
        self.draft_costs = DraftCostModel(self.draft_session.max_draft_tokens)

    @property
    def pending_count(self) -> int:
        return len(self.tokens) - self.committed


@dataclass(frozen=True, slots=True)
class GenerationBudget:
    """Limits of one generation: tokens to produce, tokens that stop it, and the history ceiling."""

    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    max_history_tokens: int | None = None


def first_stop(
    emitted: Sequence[int],
    history: Sequence[int],
    generated: int,
    budget: GenerationBudget,
    stop_sequences: Sequence[Sequence[int]],
) -> tuple[int, StopCause | None, int | None]:
    """How many of `emitted` to keep, and why they end the generation: the first stop token, or the first token
    that completes a stop sequence within this generation's output (the last `generated` history tokens, then
    `emitted`), whichever comes first."""
    longest = max((len(s) for s in stop_sequences), default=0)
    # The end of the output so far: a stop sequence may begin in an earlier step.
    output = list(history[len(history) - min(generated, longest) :]) if longest > 1 and generated else []
    for i, token in enumerate(emitted):
        if token in budget.stop_token_ids:
            return i + 1, StopCause.EOS, None
        if stop_sequences:
            output.append(token)
            index = match_stop_sequence(output, stop_sequences)
            if index is not None:
                return i + 1, StopCause.STOP_SEQUENCE, index
    return len(emitted), None, None


@dataclass(slots=True)
class StepResult:
    """What one decoder step did."""

    tokens: list[int] = field(default_factory=list)
    prefilled: int = 0
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0
    stop: StopCause | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the controls ask for them
    stop_sequence_index: int | None = None  # which stop sequence matched (stop is STOP_SEQUENCE)
    decision: DraftDecision | None = None  # the `cost` policy's choice for this step (None: it chose nothing)


@dataclass(frozen=True, slots=True)
class StepRequest:
    """One session's next step, as `Decoder.step` takes it."""

    seq: SequenceState
    params: SamplingParams
    budget: GenerationBudget
    generated: int
    controls: DecodeControls | None = None


def shared_prefix(first: Sequence[int] | np.ndarray, second: Sequence[int] | np.ndarray) -> int:
    """The length of the longest common prefix of two token sequences."""
    n = min(len(first), len(second))
    if n == 0:
        return 0
    differs = np.flatnonzero(np.asarray(first[:n], dtype=np.int64) != np.asarray(second[:n], dtype=np.int64))
    return int(differs[0]) if differs.size else n
