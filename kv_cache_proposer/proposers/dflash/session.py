"""Per-session DFlash drafting, shared by the backends.

Each session keeps the drafter's context K/V for committed positions only, under the session's KV strategy. The
verifier's features of a position arrive with the commit that makes it resident (captured by the same forward),
are projected to context K/V at once, and are never recomputed. A proposal runs one drafter forward over
`[last token, MASK x n]` at the next positions and reads the n drafts through the verifier's LM head; the block's
own K/V are staged and dropped. The backend's `DraftEngine` does the tensor work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, Protocol

import numpy as np

from kv_cache_proposer.cache import SessionCache, visible_keys
from kv_cache_proposer.cache.arrays import A
from kv_cache_proposer.errors import EngineError
from kv_cache_proposer.proposers.dflash.config import DFlashSpec


def block_masks(cache: SessionCache[Any], windows: Sequence[int | None]) -> list[np.ndarray | None]:
    """Per drafter layer, which keys the staged block reads [M, K]: the context under the session's strategy and
    the whole block both ways. None where a layer reads every key (attention then needs no mask); layers with the
    same window share one array."""
    query_pos, key_pos = cache.query_positions, cache.key_positions
    built: dict[int | None, np.ndarray | None] = {}
    for window in windows:
        if window not in built:
            allowed = visible_keys(cache.strategy, query_pos, key_pos, causal=False, window=window)
            built[window] = None if allowed.all() else allowed
    return [built[window] for window in windows]


class DraftEngine(Protocol[A]):
    """A loaded drafter bound to its verifier, on one backend."""

    @property
    def spec(self) -> DFlashSpec: ...

    @property
    def max_draft_tokens(self) -> int: ...

    def add_context(self, cache: SessionCache[A], features: A) -> None:
        """Project the verifier features [n, L*H] of the cache's next n positions to context K/V and keep them."""
        ...

    def draft(self, cache: SessionCache[A], last_token: int, count: int) -> list[int]:
        """Draft `count` tokens after `last_token`, which sits at the cache's next position."""
        ...


class DFlashDraftSession(Generic[A]):
    """One session's drafter context."""

    def __init__(self, engine: DraftEngine[A], cache: SessionCache[A]) -> None:
        self._engine = engine
        self._cache = cache

    @property
    def max_draft_tokens(self) -> int:
        return self._engine.max_draft_tokens

    @property
    def feature_layers(self) -> Sequence[int]:
        return self._engine.spec.target_layer_ids

    @property
    def nbytes(self) -> int:
        return int(self._cache.nbytes)

    def propose(self, history: Sequence[int], max_tokens: int) -> list[int]:
        # Drafting needs the features of every position before the last token; after an append the pending
        # tokens have none yet, so that step verifies them without a draft.
        if self._cache.next_position != len(history) - 1 or max_tokens < 1:
            return []
        return self._engine.draft(self._cache, history[-1], min(max_tokens, self.max_draft_tokens))

    def on_commit(self, history: Sequence[int], committed: int, features: Any | None) -> None:
        if features is None:
            raise EngineError("the DFlash drafter needs verifier features with every commit")
        count = int(features.shape[0])
        if committed - count != self._cache.next_position:
            raise EngineError(
                f"DFlash context holds {self._cache.next_position} positions but features arrived for "
                f"{committed - count}..{committed}"
            )
        if count:
            self._engine.add_context(self._cache, features)

    def release(self) -> None:
        self._cache.release()

    def clone(self, length: int) -> DFlashDraftSession:
        # The context K/V track the verifier's committed positions one for one, so they clone at the same length.
        return DFlashDraftSession(self._engine, self._cache.clone(length))
