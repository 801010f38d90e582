"""Per-session DFlash drafting, shared by the backends.

Each session keeps the drafter's context K/V for committed positions only, under the session's KV strategy. The
verifier's features of a position arrive with the commit that makes it resident (captured by the same forward),
are projected to context K/V at once, and are never recomputed. A proposal runs one drafter forward over
`[last token, MASK x n]` at the next positions and reads the n drafts through the verifier's LM head; the block's
own K/V are staged and dropped. The backend's `DraftEngine` does the tensor work.

The sessions of one proposer share a `DFlashBatchDrafter`: a batch step's proposals run as one drafter forward,
each block over its own context, positions and mask, and its commits' context projections as one projection.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, Protocol, TypeVar, cast

import numpy as np

from kv_cache_proposer.cache import KVSessionCache, SessionCache, visible_keys
from kv_cache_proposer.cache.arrays import A
from kv_cache_proposer.cache.snapshot import clone_cache
from kv_cache_proposer.errors import EngineError
from kv_cache_proposer.proposers.batch import DraftCommit, DraftRequest
from kv_cache_proposer.proposers.dflash.config import DFlashSpec
from kv_cache_proposer.strategies import KVStrategy

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class DrafterWindow:
    """The residency of a windowed drafter's context: the last `window` positions, none before `start`.

    `start` is where a context began that could not hold the window before it (a fork at a point whose window
    was already evicted): it drafts with less context until its window fills again. Slots are a ring of `window`.
    """

    window: int
    start: int = 0

    @property
    def name(self) -> str:
        return "drafter_window"

    @property
    def bounded_slots(self) -> int | None:
        return self.window

    def slot_of(self, position: int) -> int:
        return position % self.window

    def slots_of(self, positions: np.ndarray) -> np.ndarray:
        return positions % self.window

    def resident_count(self, committed: int) -> int:
        return max(0, min(committed - self.start, self.window))

    def resident_positions(self, committed: int) -> np.ndarray:
        return np.arange(max(self.start, committed - self.window), committed, dtype=np.int64)

    def visible(self, query_pos: Any, key_pos: Any) -> Any:
        return (query_pos - key_pos <= self.window) & (key_pos >= self.start)


def context_strategy(strategy: KVStrategy, windows: Sequence[int | None]) -> KVStrategy:
    """The strategy a session's drafter context is held under. When every drafter layer attends over a window, the
    last `max(windows)` positions alone (`DrafterWindow`): the drafter reads nothing older, so its context stays
    that size whatever the history. Otherwise the session's own strategy."""
    if windows and all(window is not None for window in windows):
        return DrafterWindow(max(cast(int, window) for window in windows))
    return strategy


def block_masks(cache: SessionCache[Any], windows: Sequence[int | None]) -> list[np.ndarray | None]:
    """Per drafter layer, which keys the staged block reads [M, K]: the context under the session's strategy and
    the whole block both ways. None where a layer reads every key (attention then needs no mask); layers with the
    same window share one array."""
    query_pos, key_pos = cache.call.query_positions, cache.call.key_positions
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


class BatchDraftEngine(DraftEngine[A], Protocol[A]):
    """A drafter that also runs several sessions' blocks, or their context projections, in one forward."""

    def draft_batch(self, blocks: Sequence[tuple[SessionCache[A], int, int]]) -> list[list[int]]:
        """`draft(cache, last_token, count)` of every block (distinct caches) in one drafter forward."""
        ...

    def add_context_batch(self, items: Sequence[tuple[SessionCache[A], A]]) -> list[Exception | None]:
        """`add_context(cache, features)` of every item (distinct caches) with one projection. Per item, the error
        that kept its context from being stored; raises (having stored nothing) only when the projection fails."""
        ...


class DFlashBatchDrafter(Generic[A]):
    """Drafting of several sessions of one DFlash proposer together (`BatchDrafter`)."""

    def __init__(self, engine: BatchDraftEngine[A]) -> None:
        self._engine = engine

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[list[int] | Exception]:
        results: list[list[int] | Exception] = [[] for _ in requests]
        blocks: list[tuple[int, SessionCache[A], int, int]] = []  # (request, cache, last token, count)
        for index, request in enumerate(requests):
            session = self._own(request.session)
            if isinstance(session, Exception):
                results[index] = session
                continue
            count = session.draft_count(request.history, request.max_tokens)
            if count:
                blocks.append((index, session._cache, request.history[-1], count))
        engine = self._engine
        drafts: list[list[int] | Exception]
        if len(blocks) == 1:
            _, cache, last, count = blocks[0]
            drafts = [_outcome(lambda: engine.draft(cache, last, count))]
        elif blocks:
            try:
                drafts = list(engine.draft_batch([(cache, last, count) for _, cache, last, count in blocks]))
            except Exception:  # each block alone, so the error lands on the session that caused it
                drafts = [_outcome(partial(engine.draft, cache, last, count)) for _, cache, last, count in blocks]
        else:
            drafts = []
        for (index, *_), draft in zip(blocks, drafts, strict=True):
            results[index] = draft
        return results

    def on_commit_batch(self, commits: Sequence[DraftCommit]) -> list[Exception | None]:
        results: list[Exception | None] = [None] * len(commits)
        items: list[tuple[int, SessionCache[A], A]] = []  # (commit, cache, features)
        for index, commit in enumerate(commits):
            session = self._own(commit.session)
            if isinstance(session, Exception):
                results[index] = session
                continue
            try:
                features = session.new_context(commit.committed, commit.features)
            except Exception as exc:  # handed to that session's caller
                results[index] = exc
                continue
            if features is not None:
                items.append((index, session._cache, features))
        engine = self._engine
        errors: list[Exception | None]
        if len(items) == 1:
            _, cache, features = items[0]
            errors = [_outcome(lambda: engine.add_context(cache, features))]
        elif items:
            try:
                errors = engine.add_context_batch([(cache, features) for _, cache, features in items])
            except Exception:  # nothing was stored: each alone, so the error lands on its own session
                errors = [_outcome(partial(engine.add_context, cache, features)) for _, cache, features in items]
        else:
            errors = []
        for (index, *_), error in zip(items, errors, strict=True):
            results[index] = error
        return results

    def _own(self, session: object) -> DFlashDraftSession[A] | Exception:
        if isinstance(session, DFlashDraftSession) and session._engine is self._engine:
            return session
        return EngineError("a DFlash batch takes the sessions of its own proposer only")


def _outcome(run: Callable[[], T]) -> T | Exception:
    """What `run` returns, or the exception it raises (handed to the session it ran for)."""
    try:
        return run()
    except Exception as exc:
        return exc


class DFlashDraftSession(Generic[A]):
    """One session's drafter context."""

    def __init__(
        self,
        engine: DraftEngine[A],
        cache: SessionCache[A],
        batch: DFlashBatchDrafter[A] | None = None,
    ) -> None:
        """`batch`: the batch drafter shared by the proposer's sessions (None: this session drafts alone)."""
        self._engine = engine
        self._cache = cache
        self._batch = batch

    @classmethod
    def opened(
        cls,
        engine: DraftEngine[A],
        strategy: KVStrategy,
        windows: Sequence[int | None],
        ops: Any,
        batch: DFlashBatchDrafter[A] | None,
    ) -> DFlashDraftSession[A]:
        """A new session's drafter context (one layer per window), held under `context_strategy`."""
        cache = KVSessionCache(context_strategy(strategy, windows), num_layers=len(windows), ops=ops)
        return cls(engine, cache, batch)

    @property
    def batch_drafter(self) -> DFlashBatchDrafter[A] | None:
        return self._batch

    @property
    def max_draft_tokens(self) -> int:
        return self._engine.max_draft_tokens

    @property
    def feature_layers(self) -> Sequence[int]:
        return self._engine.spec.target_layer_ids

    @property
    def nbytes(self) -> int:
        return self._cache.footprint().nbytes

    def draft_count(self, history: Sequence[int], max_tokens: int) -> int:
        """How many tokens a proposal after `history` drafts (0: none)."""
        # Drafting needs the features of every position before the last token; after an append the pending
        # tokens have none yet, so that step verifies them without a draft.
        if self._cache.next_position != len(history) - 1 or max_tokens < 1:
            return 0
        return min(max_tokens, self.max_draft_tokens)

    def new_context(self, committed: int, features: Any | None) -> A | None:
        """The features a commit up to `committed` adds to this session's context (None: no position); raises
        when they do not continue it."""
        if features is None:
            raise EngineError("the DFlash drafter needs verifier features with every commit")
        count = int(features.shape[0])
        if committed - count != self._cache.next_position:
            raise EngineError(
                f"DFlash context holds {self._cache.next_position} positions but features arrived for "
                f"{committed - count}..{committed}"
            )
        return cast(A, features) if count else None

    def propose(self, history: Sequence[int], max_tokens: int) -> list[int]:
        count = self.draft_count(history, max_tokens)
        return self._engine.draft(self._cache, history[-1], count) if count else []

    def on_commit(self, history: Sequence[int], committed: int, features: Any | None) -> None:
        context = self.new_context(committed, features)
        if context is not None:
            self._engine.add_context(self._cache, context)

    def release(self) -> None:
        self._cache.release()

    def clone(self, length: int) -> DFlashDraftSession:
        # The context K/V track the verifier's committed positions one for one, so they clone at the same length.
        # A context held over the drafter's window alone keeps what it still holds of the window before `length`:
        # the clone drafts with less context until its window fills again.
        held = self._cache.strategy
        if isinstance(held, DrafterWindow):
            cache = cast(KVSessionCache[A], self._cache)
            oldest = max(held.start, cache.next_position - held.window)  # the oldest position still held
            twin = cache.clone_under(length, DrafterWindow(held.window, start=min(oldest, length)))
            return DFlashDraftSession(self._engine, twin, self._batch)
        return DFlashDraftSession(self._engine, clone_cache(self._cache, length), self._batch)
