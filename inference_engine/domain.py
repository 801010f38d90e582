"""Transport-neutral requests and events of the service. The gRPC layer converts to and from these in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kv_cache_proposer.controls import TokenLogprob
from kv_cache_proposer.grammar import GrammarSpec


class StopReason(Enum):
    MAX_TOKENS = "max_tokens"
    EOS = "eos"
    CANCELLED = "cancelled"
    TRUNCATED = "truncated"
    STOP_SEQUENCE = "stop_sequence"
    GRAMMAR_DEAD_END = "grammar_dead_end"


@dataclass(frozen=True, slots=True)
class CreateParams:
    label: str = ""
    eos_token_ids: tuple[int, ...] = ()
    initial_token_ids: tuple[int, ...] = ()
    kv_strategy: str | None = None  # None: the server default
    sink: int | None = None
    window: int | None = None
    no_default_eos: bool = False  # with eos_token_ids empty: True gives no EOS ids, False the model's
    kv_compressor: str | None = None  # None: the server default
    kv_q_range: int | None = None  # None: the server default
    single_shot: bool = False  # the session ends with the request that made it (the HTTP shim's)


@dataclass(frozen=True, slots=True)
class GenerateParams:
    max_tokens: int
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    grammar: GrammarSpec | None = None
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    penalty_window_tokens: int | None = None
    min_p: float | None = None


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_id: int
    logprobs: TokenLogprob | None = None  # when the generation asked for log-probabilities


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
    stop_sequence_index: int | None = None


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
    restored_token_count: int = 0  # dlm_restore: evicted positions restored now (transient)
    kv_resident_bytes: int = 0
    kv_restored_bytes: int = 0
    kv_restoration_state_bytes: int = 0
    kv_peak_restored_bytes: int = 0
    history_token_bytes: int = 0  # dlm_restore: token ids kept to rebuild evicted K/V by a forward
    kv_peak_bytes: int = 0  # the most bytes the session has held at once (after each step, and now)
    draft_state_bytes: int = 0  # the proposer's state: a drafter's K/V, the n-gram index (in kv_live_bytes)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_generate_tokens: int
    max_append_tokens: int
    max_history_tokens: int
    max_sessions: int
    max_message_bytes: int
    max_concurrent_generations: int
    queue_deadline_s: float
    max_batch_size: int
    prefill_chunk_tokens: int


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model's facts and the server's session defaults and limits."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    trained_context_tokens: int
    backend: str
    model_name: str
    description: str
    chat_template: str | None
    default_kv_strategy: str
    default_sink_tokens: int
    default_window_tokens: int
    limits: ServerLimits
    proposer: str
    server_version: str
