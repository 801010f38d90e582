"""The proposer interface: a proposer opens one draft session per generation session."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class DraftSession(Protocol):
    """Per-session drafting state."""

    def propose(self, history: Sequence[int], max_tokens: int) -> list[int]:
        """Draft up to `max_tokens` tokens that continue `history` (may return fewer, or none)."""
        ...

    def on_commit(self, history: Sequence[int], committed: int) -> None:
        """Learn that the verifier committed the first `committed` positions of `history`."""
        ...

    def release(self) -> None: ...


class Proposer(Protocol):
    @property
    def name(self) -> str: ...

    def open(self) -> DraftSession: ...


class NoDraftSession:
    """Drafts nothing: every step verifies the pending tokens alone."""

    def propose(self, history: Sequence[int], max_tokens: int) -> list[int]:
        return []

    def on_commit(self, history: Sequence[int], committed: int) -> None:
        return None

    def release(self) -> None:
        return None


class NoProposer:
    """The empty proposer: plain autoregressive decoding through the same step."""

    @property
    def name(self) -> str:
        return "none"

    def open(self) -> DraftSession:
        return NoDraftSession()
