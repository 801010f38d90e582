"""The proposer interface: a proposer opens one draft session per generation session."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any, Protocol

from kv_cache_proposer.strategies import KVStrategy


class DraftPolicy(StrEnum):
    """How many tokens a proposal may hold.

    `full`: every proposal may hold the proposer's whole limit (a DFlash block drafts all of it in one forward, a
    lookup costs nothing per token, so a shorter draft saves nothing but accepted tokens). `adaptive`: the limit
    shrinks by one after a partly rejected draft and grows by two after a fully accepted one, which pays where each
    drafted token costs a forward of its own (a draft model). `cost`: each session times its proposals, verify
    forwards and plain steps and estimates its acceptance, and drafts the length expected to give the most tokens per
    second, or nothing when a plain step is expected faster (`cost_model.py`).
    """

    FULL = "full"
    ADAPTIVE = "adaptive"
    COST = "cost"


class DraftSession(Protocol):
    """Per-session drafting state, driven by the decode step."""

    @property
    def max_draft_tokens(self) -> int:
        """The most tokens one proposal may hold (0: never drafts)."""
        ...

    @property
    def feature_layers(self) -> Sequence[int]:
        """Verifier layers whose outputs this session needs for every committed position (empty: none)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of per-session state held (a drafter's own K/V)."""
        ...

    def propose(self, history: Sequence[int], max_tokens: int) -> list[int]:
        """Draft up to `max_tokens` tokens that continue `history` (may return fewer, or none)."""
        ...

    def on_commit(self, history: Sequence[int], committed: int, features: Any | None) -> None:
        """Learn that the verifier now holds the first `committed` positions of `history`.

        `features` holds the requested layer outputs of the positions committed by this forward (the last
        rows up to `committed`), or None when no layers were requested.
        """
        ...

    def release(self) -> None: ...

    def clone(self, length: int) -> DraftSession:
        """An independent draft session for a copy of the history's first `length` positions, whose verifier cache
        is this session's verifier cache cloned at `length`."""
        ...


class Proposer(Protocol):
    """A drafting method loaded once per daemon; each session opens its own draft session."""

    @property
    def name(self) -> str: ...

    @property
    def draft_policy(self) -> DraftPolicy:
        """The draft-length policy `serve --draft-policy auto` runs this proposer under."""
        ...

    def open(self, strategy: KVStrategy) -> DraftSession:
        """Start drafting for a session whose verifier cache follows `strategy`."""
        ...


class NoDraftSession:
    """Drafts nothing: every step verifies the pending tokens alone."""

    max_draft_tokens = 0
    feature_layers: Sequence[int] = ()
    nbytes = 0

    def propose(self, history: Sequence[int], max_tokens: int) -> list[int]:
        return []

    def on_commit(self, history: Sequence[int], committed: int, features: Any | None) -> None:
        return None

    def release(self) -> None:
        return None

    def clone(self, length: int) -> NoDraftSession:
        return NoDraftSession()


class NoProposer:
    """The empty proposer: plain autoregressive decoding through the same step."""

    draft_policy = DraftPolicy.FULL

    @property
    def name(self) -> str:
        return "none"

    def open(self, strategy: KVStrategy) -> DraftSession:
        return NoDraftSession()
