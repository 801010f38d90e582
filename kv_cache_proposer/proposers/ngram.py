"""Prompt-lookup drafting: continue the history the way it continued the last time its suffix occurred.

No model: the session's own history is the source, which suits agent and code workloads that repeat spans of
their context (tool output, file contents, identifiers).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_cache_proposer.proposers.base import DraftPolicy
from kv_cache_proposer.strategies import KVStrategy

# A one-token suffix matches somewhere in almost any long history and rarely predicts what comes next; a block of
# 8 (7 drafts) verified faster than one of 9 on a CPU (docs/speculative-decoding.md).
MAX_N, MIN_N, LOOKAHEAD = 4, 2, 7
# What an index entry holds besides its dict slot: its n-gram's tuple (whose items are the history's own int
# objects, held anyway) and the position it maps to, an int object shared by the n-grams ending there.
_TUPLE_BYTES, _INT_BYTES = sys.getsizeof(()), sys.getsizeof(1 << 20)
_ITEM_BYTES = sys.getsizeof((0,)) - _TUPLE_BYTES


@dataclass(slots=True)
class NgramDraftSession:
    """Looks up the longest suffix of `max_n` down to `min_n` tokens that occurred earlier in the history, and
    proposes the tokens that followed its most recent earlier occurrence.

    An index from every n-gram of `min_n` to `max_n` tokens to the position after its latest occurrence is kept up
    to date as positions are committed (prefill chunks included), so a proposal costs O(max_n) whatever the
    history length, and a session that starts drafting late pays no indexing of its history in its first proposal
    (where a cost model would take it for the price of every proposal). Its bytes grow with the history's distinct
    n-grams and count as the session's drafting state (`nbytes`), as a drafter's K/V do.
    """

    max_n: int
    min_n: int
    lookahead: int
    _index: list[dict[tuple[int, ...], int]] = field(default_factory=list)  # [n - min_n]: n-gram -> position
    _indexed: int = 0  # history positions whose n-grams (ending there) are indexed

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"ngram sizes need 1 <= min_n <= max_n, got {self.min_n} and {self.max_n}")
        self._index = self._empty_index()

    @property
    def max_draft_tokens(self) -> int:
        return self.lookahead

    @property
    def feature_layers(self) -> Sequence[int]:
        return ()

    @property
    def nbytes(self) -> int:
        """The index's bytes: each dict's table and each entry's tuple, and the positions its entries map to (one
        int object per position, shared by its n-grams: about as many as the largest dict has entries). An empty
        index reports none, as an empty cache does: a session that has committed nothing holds nothing the KV
        budget should evict it for."""
        if not any(self._index):
            return 0
        tables = sum(
            sys.getsizeof(grams) + len(grams) * (_TUPLE_BYTES + n * _ITEM_BYTES)
            for n, grams in enumerate(self._index, self.min_n)
        )
        return tables + max(map(len, self._index)) * _INT_BYTES

    def propose(self, history: Sequence[int], max_tokens: int) -> list[int]:
        end = len(history)
        # Index n-grams ending before the last position, so the suffix never matches itself.
        self._extend_index(history, end - 1)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            follow = self._index[n - self.min_n].get(tuple(history[end - n :]))
            if follow is not None:
                return list(history[follow : min(follow + max_tokens, end)])
        return []

    def on_commit(self, history: Sequence[int], committed: int, features: Any | None) -> None:
        self._extend_index(history, min(committed, len(history) - 1))

    def release(self) -> None:
        self._index, self._indexed = self._empty_index(), 0

    def _empty_index(self) -> list[dict[tuple[int, ...], int]]:
        return [{} for _ in range(self.min_n, self.max_n + 1)]

    def clone(self, length: int) -> NgramDraftSession:
        fork = NgramDraftSession(max_n=self.max_n, min_n=self.min_n, lookahead=self.lookahead)
        if length >= self._indexed:  # every indexed n-gram lies within the fork's history
            fork._index, fork._indexed = [dict(grams) for grams in self._index], self._indexed
        # else the fork indexes its own history from the start, at its next commit or proposal
        return fork

    def _extend_index(self, history: Sequence[int], upto: int) -> None:
        for last in range(self._indexed, upto):
            follow = last + 1
            for n in range(self.min_n, min(self.max_n, follow) + 1):
                self._index[n - self.min_n][tuple(history[follow - n : follow])] = follow
        self._indexed = max(self._indexed, upto)


@dataclass(frozen=True, slots=True)
class NgramProposer:
    """Prompt lookup over each session's own history."""

    max_n: int = MAX_N
    min_n: int = MIN_N
    lookahead: int = LOOKAHEAD

    draft_policy = DraftPolicy.COST

    @property
    def name(self) -> str:
        return "ngram"

    def open(self, strategy: KVStrategy) -> NgramDraftSession:
        return NgramDraftSession(max_n=self.max_n, min_n=self.min_n, lookahead=self.lookahead)
