"""Plain values the SDK returns and accepts: session descriptions, generation statistics, settings."""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum

from kakeya.errors import InvalidArgument


class StopReason(Enum):
    """Why a generation ended."""

    MAX_TOKENS = "max_tokens"
    """`max_tokens` tokens were generated."""
    EOS = "eos"
    """An EOS or stop token was generated; it is the last token of the stream."""
    CANCELLED = "cancelled"
    """The client cancelled, the session was closed, or the server shut down."""
    TRUNCATED = "truncated"
    """The session reached the server's maximum history length."""


class KvStrategy(Enum):
    """How the server holds a session's KV cache."""

    FULL = "full"
    """Every position stays resident; memory grows with the history."""
    SINK_WINDOW = "sink_window"
    """The first `sink_tokens` and the last `window_tokens` positions stay resident."""


class KvCompressor(Enum):
    """How the server holds a session's committed K/V."""

    NONE = "none"
    """Dense K/V in the model's dtype."""
    KAKEYA_D4 = "kakeya_d4"
    """Packed KakeyaLattice codes on the D4 lattice."""
    KAKEYA_E8 = "kakeya_e8"
    """Packed KakeyaLattice codes on the E8 lattice."""


@dataclass(frozen=True, slots=True)
class GenerationStats:
    """Statistics of one generation.

    `server_reported` is True when they come from the server's final message. When the client stops reading a
    `Generate` stream early, the server's message never arrives: the SDK then records `stop_reason` CANCELLED and
    the number of tokens it received, and `server_reported` is False (the server may have added a few more tokens
    to the history; `Session.info(history_tail_tokens=...)` tells which). A cancelled `converse()` generation is
    always server-reported.
    """

    stop_reason: StopReason
    generated_token_count: int
    prefill_token_count: int = 0
    prefill_duration_s: float = 0.0
    total_duration_s: float = 0.0
    time_to_first_token_s: float = 0.0
    draft_token_count: int = 0
    accepted_draft_token_count: int = 0
    verifier_forward_count: int = 0
    truncated_token_count: int = 0
    """History positions no longer resident in the cache when the generation started (0: none were evicted)."""
    server_reported: bool = True


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """A session as the server describes it."""

    history_length: int
    kv_live_bytes: int
    inv1_violations: int
    inv2_violations: int
    idle_s: float
    kv_strategy: KvStrategy | None
    resident_token_count: int
    kv_compressed_bytes: int
    pending_token_count: int
    evicted_token_count: int
    label: str
    generating: bool
    sink_tokens: int
    window_tokens: int
    history_tail: tuple[int, ...] = ()
    """The last `history_tail_tokens` history tokens, when asked for."""
    kv_compressor: KvCompressor | None = None
    kv_q_range: int = 0
    """Lattice range Q of the session's compressor (0: not compressed)."""
    kv_dense_equivalent_bytes: int = 0
    """Bytes the resident K/V would take dense in the model's dtype."""
    kv_escaped_blocks: int = 0
    """Lattice blocks held by escape (off the lattice after clamping)."""

    @property
    def invariant_violations(self) -> int:
        """Cache invariant violations counted on the session (INV-1 and INV-2)."""
        return self.inv1_violations + self.inv2_violations


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """TLS settings of a client channel. With no root certificates the system's trust store is used."""

    root_certificates: bytes | None = None
    """PEM bundle of the certificate authorities to trust (a self-signed server certificate works here)."""
    certificate_chain: bytes | None = None
    """PEM client certificate chain, for servers that ask for one."""
    private_key: bytes | None = None
    """PEM private key of `certificate_chain`."""
    server_name: str | None = None
    """Host name to verify the certificate against, when it differs from the address."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter for idempotent calls (`info`, `close`) that fail with UNAVAILABLE.

    Creating sessions, appending and generating are never retried: a lost reply could mean the server already
    acted on them. `max_attempts=1` disables retries. All attempts share the call's `timeout_s`.
    """

    max_attempts: int = 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise InvalidArgument(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise InvalidArgument(
                f"backoffs must satisfy 0 < initial_backoff_s <= max_backoff_s, got "
                f"{self.initial_backoff_s} and {self.max_backoff_s}"
            )
        if self.multiplier < 1:
            raise InvalidArgument(f"multiplier must be >= 1, got {self.multiplier}")

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based): half to all of the capped exponential."""
        ceiling = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        return ceiling * random.uniform(0.5, 1.0)
