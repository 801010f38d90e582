"""Transport-neutral requests and events of the service. The gRPC layer converts to and from these in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class StopReason(Enum):
    MAX_TOKENS = "max_tokens"
    EOS = "eos"
    CANCELLED = "cancelled"
    TRUNCATED = "truncated"


@dataclass(frozen=True, slots=True)
class CreateParams:
    label: str = ""
    eos_token_ids: tuple[int, ...] = ()
    initial_token_ids: tuple[int, ...] = ()
    kv_strategy: str | None = None  # None: the server default
    sink: int | None = None
    window: int | None = None
    kv_compressor: str | None = None  # None: the server default
    kv_q_range: int | None = None  # None: the server default


@dataclass(frozen=True, slots=True)
class GenerateParams:
    max_tokens: int
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_id: int


@dataclass(frozen=True, slots=True)
class TruncatedEvent:
    dropped_token_count: int


@dataclass(frozen=True, slots=True)
class GenerationStats:
    stop_reason: StopReason
    generated_token_count: int = 0
    prefill_token_count: int = 0
    prefill_duration_s: float = 0.0
    total_duration_s: float = 0.0
    time_to_first_token_s: float = 0.0
    draft_token_count: int = 0
    accepted_draft_token_count: int = 0
    verifier_forward_count: int = 0


@dataclass(frozen=True, slots=True)
class DoneEvent:
    stats: GenerationStats


GenerateEvent = TokenEvent | TruncatedEvent | DoneEvent


@dataclass(frozen=True, slots=True)
class SessionInfo:
    history_length: int
    kv_live_bytes: int
    idle_seconds: float
    kv_strategy: str
    resident_token_count: int
    kv_compressed_bytes: int
    pending_token_count: int
    evicted_token_count: int
    client_label: str
    generating: bool
    sink_tokens: int = 0
    window_tokens: int = 0
    invariant_violations: dict[str, int] = field(default_factory=dict)
    history_tail: tuple[int, ...] = ()
    kv_compressor: str = "none"
    kv_q_range: int = 0  # 0: no lattice
    kv_dense_equivalent_bytes: int = 0
    kv_escaped_blocks: int = 0
