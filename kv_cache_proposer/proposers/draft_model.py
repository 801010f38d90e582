"""Drafting with a smaller autoregressive model that shares the verifier's vocabulary.

The draft model keeps its own per-session cache. History tokens are final (the history is append-only), so they
are committed to it as soon as they are seen; drafted tokens are only staged, and after verification the staged
drafts the verifier accepted are committed while the rest are dropped. A rejected draft therefore never enters
the draft model's cache either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kv_cache_proposer.cache.snapshot import clone_cache
from kv_cache_proposer.errors import ModelLoadError
from kv_cache_proposer.proposers.base import DraftPolicy
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import KVStrategy
from kv_cache_proposer.verifier import CausalLM, SessionCache, Verifier

_GREEDY = SamplingParams()


class DraftModelSession:
    """One session's draft-model cache and the drafts staged in it."""

    def __init__(
        self, model: CausalLM[Any], strategy: KVStrategy, *, max_draft_tokens: int, prefill_chunk: int
    ) -> None:
        self._model = model
        self._cache: SessionCache[Any] = model.new_cache(strategy)
        self._max_draft_tokens = max_draft_tokens
        self._prefill_chunk = prefill_chunk
        self._committed = 0  # history positions whose K/V the draft cache holds
        self._staged: list[int] = []  # drafted tokens staged after them

    @property
    def max_draft_tokens(self) -> int:
        return self._max_draft_tokens

    @property
    def feature_layers(self) -> Sequence[int]:
        return ()

    @property
    def nbytes(self) -> int:
        return self._cache.footprint().nbytes

    def propose(self, history: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens < 1:
            return []
        logits = None
        while self._committed < len(history):
            chunk = history[self._committed : self._committed + self._prefill_chunk]
            logits = self._model.verify(self._cache, chunk, 1).logits
            self._model.commit(self._cache, len(chunk))
            self._committed += len(chunk)
        if logits is None:
            raise ValueError("the draft model has already seen the whole history: nothing to continue from")
        drafts = self._model.pick_tokens(logits, _GREEDY, [0])
        for i in range(1, max_tokens):
            logits = self._model.verify(self._cache, drafts[-1:], 1, extend_stage=i > 1).logits
            drafts += self._model.pick_tokens(logits, _GREEDY, [0])
        self._staged = drafts[:-1]
        return drafts

    def on_commit(self, history: Sequence[int], committed: int, features: Any | None) -> None:
        keep = 0
        for token in self._staged:
            position = self._committed + keep
            if position >= committed or history[position] != token:
                break
            keep += 1
        if self._staged:
            self._model.commit(self._cache, keep)
            self._committed += keep
            self._staged = []

    def release(self) -> None:
        self._cache.release()

    def clone(self, length: int) -> DraftModelSession:
        """Copy the draft cache up to `length` positions; when a bounded cache evicted some of them, start empty
        and let the next proposal prefill the draft model."""
        keep = min(self._committed, length)
        try:
            cache = clone_cache(self._cache, keep)
        except ValueError:
            keep, cache = 0, clone_cache(self._cache, 0)
        twin = DraftModelSession(
            self._model,
            self._cache.strategy,
            max_draft_tokens=self._max_draft_tokens,
            prefill_chunk=self._prefill_chunk,
        )
        twin._cache.release()
        twin._cache, twin._committed = cache, keep
        return twin


class DraftModelProposer:
    """A smaller causal LM loaded by the same backend as the verifier."""

    def __init__(
        self, model: CausalLM[Any], verifier: Verifier[Any], *, max_draft_tokens: int, prefill_chunk: int
    ) -> None:
        if model.vocab_size != verifier.vocab_size:
            raise ModelLoadError(
                f"the draft model's vocabulary ({model.vocab_size}) differs from the verifier's "
                f"({verifier.vocab_size}); it must use the same tokenizer"
            )
        if max_draft_tokens < 1:
            raise ValueError("max_draft_tokens must be >= 1")
        self._model = model
        self._max_draft_tokens = max_draft_tokens
        self._prefill_chunk = prefill_chunk

    draft_policy = DraftPolicy.ADAPTIVE

    @property
    def name(self) -> str:
        return "draft_model"

    def open(self, strategy: KVStrategy) -> DraftModelSession:
        return DraftModelSession(
            self._model, strategy, max_draft_tokens=self._max_draft_tokens, prefill_chunk=self._prefill_chunk
        )
