"""Drafting several sessions together: the optional batch interface of a proposer, and the dispatch that uses it.

A draft session whose proposer can run several sessions' drafting in one forward names its `BatchDrafter`
(`BatchableDraftSession.batch_drafter`); every session a proposer opens names the same one. `propose_all` and
`commit_all` group the sessions of one batch step by that drafter: groups of two or more run together, every other
session proposes (or learns its commit) alone, exactly as a step of that session alone would. Each result is what
the session alone would return or raise: a failure lands on its own session and never on the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kv_cache_proposer.proposers.base import DraftSession


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """One session's proposal: `session.propose(history, max_tokens)`."""

    session: DraftSession
    history: Sequence[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class DraftCommit:
    """One session's commit: `session.on_commit(history, committed, features)`."""

    session: DraftSession
    history: Sequence[int]
    committed: int
    features: Any | None

    def deliver(self) -> None:
        """Tell the session of this commit on its own."""
        self.session.on_commit(self.history, self.committed, self.features)


class BatchDrafter(Protocol):
    """Runs the drafting work of several sessions opened by one proposer together."""

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[list[int] | Exception]:
        """Per request, what its session's `propose` returns, or the exception it raises."""
        ...

    def on_commit_batch(self, commits: Sequence[DraftCommit]) -> list[Exception | None]:
        """Per commit, what its session's `on_commit` raises (None: it learnt the commit)."""
        ...


@runtime_checkable
class BatchableDraftSession(Protocol):
    """A draft session that may draft together with other sessions of its proposer."""

    @property
    def batch_drafter(self) -> BatchDrafter | None:
        """The drafter shared by every session of this session's proposer (None: this one drafts alone)."""
        ...


def batch_drafter_of(session: DraftSession) -> BatchDrafter | None:
    """The batch drafter of `session`, or None when it proposes one session at a time."""
    return session.batch_drafter if isinstance(session, BatchableDraftSession) else None


def propose_all(requests: Sequence[DraftRequest]) -> list[list[int] | Exception]:
    """Every request's draft (or the exception its session raised), in order; sessions that share a batch drafter
    draft in one call."""
    results: list[list[int] | Exception] = [[] for _ in requests]
    for drafter, members in _groups([request.session for request in requests]).items():
        if drafter is not None and len(members) > 1:
            drafts = drafter.propose_batch([requests[i] for i in members])
            for index, draft in zip(members, drafts, strict=True):
                results[index] = draft
            continue
        for index in members:
            request = requests[index]
            try:
                results[index] = request.session.propose(request.history, request.max_tokens)
            except Exception as exc:  # handed to that session's caller
                results[index] = exc
    return results


def commit_all(commits: Sequence[DraftCommit]) -> list[Exception | None]:
    """Tell every session of its commit; per commit, the exception its session raised (None: none). Sessions that
    share a batch drafter learn their commits in one call."""
    results: list[Exception | None] = [None] * len(commits)
    for drafter, members in _groups([commit.session for commit in commits]).items():
        if drafter is not None and len(members) > 1:
            errors = drafter.on_commit_batch([commits[i] for i in members])
            for index, error in zip(members, errors, strict=True):
                results[index] = error
            continue
        for index in members:
            try:
                commits[index].deliver()
            except Exception as exc:  # handed to that session's caller
                results[index] = exc
    return results


def _groups(sessions: Sequence[DraftSession]) -> dict[BatchDrafter | None, list[int]]:
    """Indices of `sessions` by batch drafter (None: sessions that draft alone), in first-seen order."""
    groups: dict[BatchDrafter | None, list[int]] = {}
    for index, session in enumerate(sessions):
        groups.setdefault(batch_drafter_of(session), []).append(index)
    return groups
