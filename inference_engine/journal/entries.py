"""What the journal records, and the interface every journal database implements."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


class JournalError(RuntimeError):
    """The journal cannot be opened, read or written, or it belongs to another model."""


class JournalDamaged(JournalError):
    """The journal's contents cannot be read back (a corrupt file, a record that does not decode)."""


class OwnershipLost(JournalError):
    """Another daemon has taken the session over (shared journal): this daemon's copy is stale, its writes refused."""


@dataclass(frozen=True, slots=True)
class SessionHeader:
    """What a session was created with, besides its tokens."""

    session_id: str
    label: str
    eos_token_ids: tuple[int, ...]
    kv_strategy: str
    sink: int
    window: int
    kv_compressor: str = "none"  # `none`, or `<name>:<q_range>`


@dataclass(frozen=True, slots=True)
class JournalOpened:
    """A session was created (or forked, or brought back) holding `tokens`."""

    header: SessionHeader
    tokens: tuple[int, ...]
    at_unix: float


@dataclass(frozen=True, slots=True)
class JournalAppended:
    """Tokens joined a session's history: appended by the client or generated and committed."""

    session_id: str
    tokens: tuple[int, ...]
    at_unix: float


@dataclass(frozen=True, slots=True)
class JournalEnded:
    """A session ended (closed, evicted or failed): it is not brought back."""

    session_id: str


JournalEntry = JournalOpened | JournalAppended | JournalEnded


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """A live session as the journal holds it: header, whole history, time of its last journaled activity."""

    header: SessionHeader
    tokens: list[int]
    last_active_unix: float


class JournalBackend(Protocol):
    """A database holding the journal. Methods run on one thread at a time (the writer thread once it runs)."""

    @property
    def location(self) -> str:
        """Where the journal lives, for messages."""
        ...

    def load(self, model: Mapping[str, Any]) -> list[SessionRecord]:
        """The live sessions, least recently active first. Raises `JournalError` when the journal was written for
        another model while it still holds sessions, `JournalDamaged` when it cannot be read back."""
        ...

    def write(self, entries: Sequence[JournalEntry]) -> frozenset[str]:
        """Apply `entries` in order as one durable transaction (durable as the sync policy says). Returns the ids
        of sessions whose entries were refused because another daemon owns them now (a shared journal only)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class SharedJournalBackend(JournalBackend, Protocol):
    """A journal shared by the daemons of a cluster, with an ownership record per session."""

    node: str

    def take_over(self, session_id: str) -> SessionRecord | None:
        """Become the session's owner (the previous owner's writes are refused from now on) and read its whole
        history, atomically; None when the journal holds no such session."""
        ...
