"""Per-session DFlash drafting, shared by the backends.

Each session keeps the drafter's context K/V for committed positions only, under the session's KV strategy. The
verifier's features of a position arrive with the commit that makes it resident (captured by the same forward) and
are projected to context K/V once, before the session's next proposal (at most `PENDING_POSITIONS` wait): a
session whose steps decline to draft (the `cost` policy) projects a run of commits in one call, not one per commit.
A proposal runs one drafter forward over `[last token, MASK x n]` at the next positions and reads the n drafts
through the verifier's LM head; the block's own K/V are staged and dropped. The backend's `DraftEngine` does the
tensor work.

The sessions of one proposer share a `DFlashBatchDrafter`: a batch step's proposals run as one drafter forward,
each block over its own context, positions and mask, after one projection of the features its sessions' commits
left waiting.
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

PENDING_POSITIONS = 256  # committed positions whose features may wait for their projection


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

    def join_features(self, parts: Sequence[A]) -> A:
        """Features [n_i, L*H] of consecutive positions joined into one [sum n_i, L*H]."""
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
        drafting: list[tuple[int, DFlashDraftSession[A]]] = []
        for index, request in enumerate(requests):
            session = self._own(request.session)
            if isinstance(session, Exception):
                results[index] = session
                continue
            count = session.draft_count(request.history, request.max_tokens)
            if count:
                blocks.append((index, session._cache, request.history[-1], count))
                drafting.append((index, session))
        settled = self._settle(drafting)
        for index, error in settled.items():
            results[index] = error
        blocks = [block for block in blocks if block[0] not in settled]
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
        for index, commit in enumerate(commits):
            session = self._own(commit.session)
            if isinstance(session, Exception):
                results[index] = session
                continue
            results[index] = _outcome(partial(session.on_commit, commit.history, commit.committed, commit.features))
        return results

    def _settle(self, sessions: Sequence[tuple[int, DFlashDraftSession[A]]]) -> dict[int, Exception]:
        """Project the waiting features of every session (keyed by request) with one projection; the errors of
        those whose context could not take them."""
        items = [(key, session) for key, session in sessions if session._pending]
        engine = self._engine
        errors: list[Exception | None]
        if len(items) == 1:
            errors = [_outcome(items[0][1].settle)]
        elif items:
            batch = [(session._cache, session._take_pending()) for _, session in items]
            try:
                errors = engine.add_context_batch(batch)
            except Exception:  # nothing was stored: each alone, so the error lands on its own session
                errors = [_outcome(partial(engine.add_context, cache, features)) for cache, features in batch]
        else:
            errors = []
        return {key: error for (key, _), error in zip(items, errors, strict=True) if error is not None}

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
        self._pending: list[A] = []  # features of committed positions, waiting for their projection
        self._pending_count = 0

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
        waiting: Any = self._pending
        return self._cache.footprint().nbytes + sum(int(part.nbytes) for part in waiting)

    @property
    def _held(self) -> int:
        """Positions whose features this session has (projected or waiting)."""
        return self._cache.next_position + self._pending_count

    def settle(self) -> None:
        """Project the waiting features to context K/V and keep them."""
        if self._pending:
            self._engine.add_context(self._cache, self._take_pending())

    def _take_pending(self) -> A:
        parts, self._pending, self._pending_count = self._pending, [], 0
        return parts[0] if len(parts) == 1 else self._engine.join_features(parts)

    def draft_count(self, history: Sequence[int], max_tokens: int) -> int:
        """How many tokens a proposal after `history` drafts (0: none)."""
        # Drafting needs the features of every position before the last token; after an append the pending
        # tokens have none yet, so that step verifies them without a draft.
        if self._held != len(history) - 1 or max_tokens < 1:
            return 0
        return min(max_tokens, self.max_draft_tokens)

    def new_context(self, committed: int, features: Any | None) -> A | None:
        """The features a commit up to `committed` adds to this session's context (None: no position); raises
        when they do not continue it."""
        if features is None:
            raise EngineError("the DFlash drafter needs verifier features with every commit")
        count = int(features.shape[0])
        if committed - count != self._held:
            raise EngineError(
                f"DFlash context holds {self._held} positions but features arrived for {committed - count}..{committed}"
            )
        return cast(A, features) if count else None

    def propose(self, history: Sequence[int], max_tokens: int) -> list[int]:
        count = self.draft_count(history, max_tokens)
        if not count:
            return []
        self.settle()
        return self._engine.draft(self._cache, history[-1], count)

    def on_commit(self, history: Sequence[int], committed: int, features: Any | None) -> None:
        context = self.new_context(committed, features)
        if context is not None:
            self._pending.append(context)
            self._pending_count += int(context.shape[0])  # type: ignore[attr-defined]
            if self._pending_count >= PENDING_POSITIONS:
                self.settle()

    def release(self) -> None:
        self._pending, self._pending_count = [], 0
        self._cache.release()

    def clone(self, length: int) -> DFlashDraftSession:
        # The context K/V track the verifier's committed positions one for one, so they clone at the same length.
        # A context held over the drafter's window alone keeps what it still holds of the window before `length`:
        # the clone drafts with less context until its window fills again.
        self.settle()
        held = self._cache.strategy
        if isinstance(held, DrafterWindow):
            cache = cast(KVSessionCache[A], self._cache)
            oldest = max(held.start, cache.next_position - held.window)  # the oldest position still held
            twin = cache.clone_under(length, DrafterWindow(held.window, start=min(oldest, length)))
            return DFlashDraftSession(self._engine, twin, self._batch)
        return DFlashDraftSession(self._engine, clone_cache(self._cache, length), self._batch)
