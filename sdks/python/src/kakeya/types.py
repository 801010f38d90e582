"""Plain values the SDK returns and accepts: session descriptions, generation statistics, settings."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypedDict

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
    STOP_SEQUENCE = "stop_sequence"
    """A stop sequence was generated; it ends the stream (`GenerationStats.stop_sequence_index` says which)."""
    GRAMMAR_DEAD_END = "grammar_dead_end"
    """The grammar allowed no token at all (for instance one the model's tokenizer cannot spell)."""


class KvStrategy(Enum):
    """How the server holds a session's KV cache."""

    FULL = "full"
    """Every position stays resident; memory grows with the history."""
    SINK_WINDOW = "sink_window"
    """The first `sink_tokens` and the last `window_tokens` positions stay resident."""
    DLM_RESTORE = "dlm_restore"
    """Resident like SINK_WINDOW; every evicted position is restored for each forward by the server's restoration
    plan, so nothing leaves the model's attention."""


class KvCompressor(Enum):
    """How the server holds a session's committed K/V."""

    NONE = "none"
    """Dense K/V in the model's dtype."""
    KAKEYA_D4 = "kakeya_d4"
    """Packed KakeyaLattice codes on the D4 lattice."""
    KAKEYA_E8 = "kakeya_e8"
    """Packed KakeyaLattice codes on the E8 lattice."""
    KAKEYA_D4S = "kakeya_d4s"
    """D4 codes with one fp16 scale per vector instead of a norm and a scale."""
    KAKEYA_E8S = "kakeya_e8s"
    """E8 codes with one fp16 scale per vector instead of a norm and a scale."""


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
    stop_sequence_index: int | None = None
    """With stop reason STOP_SEQUENCE: the index of the stop sequence that matched."""


# Compression details the repr leaves out for a session that is not compressed.
_SHOWN_WHEN_COMPRESSED = ("kv_q_range", "kv_dense_equivalent_bytes", "kv_escaped_blocks")
# Restoration details the repr leaves out for a session that restores nothing.
_SHOWN_WHEN_RESTORING = (
    "restored_token_count",
    "kv_resident_bytes",
    "kv_restored_bytes",
    "kv_restoration_state_bytes",
    "kv_peak_restored_bytes",
    "history_token_bytes",
)


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
    history_tail: tuple[int, ...] = field(default=(), repr=False)
    """The last `history_tail_tokens` history tokens, when asked for (the repr shows only their count)."""
    kv_compressor: KvCompressor | None = None
    kv_q_range: int = 0
    """Lattice range Q of the session's compressor (0: not compressed)."""
    kv_dense_equivalent_bytes: int = 0
    """Bytes the resident K/V would take dense in the model's dtype."""
    kv_escaped_blocks: int = 0
    """Lattice blocks held by escape (off the lattice after clamping)."""
    restored_token_count: int = 0
    """DLM_RESTORE: evicted positions whose restored K/V the server holds now (0 while the session is parked)."""
    kv_resident_bytes: int = 0
    """Bytes of resident K/V (part of `kv_live_bytes`)."""
    kv_restored_bytes: int = 0
    """DLM_RESTORE: bytes of restored K/V held now, transient (part of `kv_live_bytes`)."""
    kv_restoration_state_bytes: int = 0
    """DLM_RESTORE: bytes of the per-position state kept to restore evicted positions: the K/V of the plan's kept
    layers (part of `kv_live_bytes`)."""
    kv_peak_restored_bytes: int = 0
    """DLM_RESTORE: the most bytes of restored K/V the session has held at once."""
    history_token_bytes: int = 0
    """DLM_RESTORE: bytes of the history's token ids the server keeps to rebuild evicted K/V by a forward (part of
    `kv_live_bytes`)."""
    kv_peak_bytes: int = 0
    """The most bytes of KV cache memory the session has held at once (`kv_live_bytes` after each step of its
    generations, and now): what it needs while it generates."""
    draft_state_bytes: int = 0
    """Bytes the session's proposer holds: a drafter's or draft model's K/V, the `ngram` index (part of
    `kv_live_bytes`; 0 without a proposer)."""

    def __repr__(self) -> str:
        parts = []
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name == "history_tail" or (name in _SHOWN_WHEN_COMPRESSED and not self.kv_q_range):
                continue
            if name in _SHOWN_WHEN_RESTORING and self.kv_strategy is not KvStrategy.DLM_RESTORE:
                continue
            if isinstance(value, Enum):
                value = value.value
            parts.append(f"{name}={value:.3f}" if isinstance(value, float) else f"{name}={value!r}")
        return f"SessionInfo({', '.join(parts)}, history_tail=<{len(self.history_tail)} tokens>)"

    @property
    def invariant_violations(self) -> int:
        """Cache invariant violations counted on the session (INV-1 and INV-2)."""
        return self.inv1_violations + self.inv2_violations


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """The limits the server checks requests against."""

    max_generate_tokens: int
    """Largest `max_tokens` of a generation (the smallest is 1)."""
    max_append_tokens: int
    """Tokens one append (or the initial tokens) may carry."""
    max_history_tokens: int
    """History tokens a session may hold."""
    max_sessions: int
    """Sessions the server holds at once (creating one more evicts the least recently used idle one)."""
    max_message_bytes: int
    """Largest gRPC message the server receives or sends."""
    max_concurrent_generations: int
    """Generations running at once across sessions."""
    queue_deadline_s: float
    """Seconds a request may wait for its session or a generation slot."""
    max_batch_size: int = 0
    """Generation steps of concurrent sessions run in one verifier forward at most (0: a server that does not say)."""
    prefill_chunk_tokens: int = 0
    """Pending tokens one prefill forward takes (0: a server that does not say)."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model's facts and the server's session defaults and limits."""

    vocab_size: int
    """Token ids are in [0, vocab_size)."""
    eos_token_ids: tuple[int, ...]
    """The model's end-of-sequence ids: the default `eos_token_ids` of new sessions."""
    trained_context_tokens: int
    """Context length the model was trained for (0 when the model does not say)."""
    backend: str
    model_name: str
    description: str
    chat_template: str | None = field(repr=False)
    """The tokenizer's chat template (Jinja source), or None when the model has none."""
    default_kv_strategy: KvStrategy | None
    default_sink_tokens: int
    default_window_tokens: int
    limits: ServerLimits
    proposer: str
    server_version: str


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


@dataclass(frozen=True, slots=True)
class Grammar:
    """A grammar the generated tokens must follow; build one with `json_schema`, `regex`, `lark` or `gbnf`."""

    kind: str
    source: str

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool | str) -> Grammar:
        """One JSON value valid for `schema` (a dict, or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Output that the regular expression matches as a whole."""
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        """A context-free grammar in Lark syntax (llguidance's dialect), starting at `start`."""
        return cls("lark", grammar)

    @classmethod
    def gbnf(cls, grammar: str) -> Grammar:
        """A context-free grammar in llama.cpp's GBNF syntax, starting at `root`."""
        return cls("gbnf", grammar)


@dataclass(frozen=True, slots=True)
class GenerationControls:
    """Per-generation controls beyond temperature, top-p, top-k and the seed.

    - `grammar`: constrain the output; a completed grammar ends with the model's end-of-sequence token (EOS).
    - `stop_sequences`: token-id sequences that end the generation after their first complete match in the
      generated tokens (STOP_SEQUENCE; the matched tokens are streamed and stay in the history).
    - `logprobs`: receive each token's log-probability (`TokenStream.logprobs`), with `top_logprobs`
      alternatives per position (at most the server's `--max-top-logprobs`, 20 by default).
    - `repetition_penalty` (> 0, 1 = none), `presence_penalty`, `frequency_penalty` over the last
      `penalty_window_tokens` history tokens (server default 64); `min_p` in [0, 1].
    """

    grammar: Grammar | None = None
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    penalty_window_tokens: int | None = None
    min_p: float | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A generated token, its log-probability, and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


class SessionSettings(TypedDict, total=False):
    """The settings of a new session, each optional: the keyword arguments of `Client.create_session` and
    `AsyncClient.create_session` besides `routing_key`.

    `initial_tokens` start the history (pending until the first generation); `eos_token_ids` end every generation
    of the session with stop reason EOS (None, the default, takes the model's ids; an empty list gives none);
    `label` names the session in `SessionInfo`; `kv_strategy`, `sink_tokens`, `window_tokens`, `kv_compressor` and
    `kv_q_range` override the server's defaults for this session.
    """

    initial_tokens: Iterable[int]
    eos_token_ids: Iterable[int] | None
    label: str
    kv_strategy: KvStrategy | str | None
    sink_tokens: int | None
    window_tokens: int | None
    kv_compressor: KvCompressor | str | None
    kv_q_range: int | None


class SamplingOptions(TypedDict, total=False):
    """How a generation picks its tokens, each optional: the keyword arguments every `generate` takes.

    Unset `temperature` (or 0) is greedy decoding; `seed` makes sampling reproducible; `top_p` and `top_k` narrow
    the candidates; `stop_token_ids` end the generation with stop reason EOS (the stop token is streamed);
    `controls` adds a grammar, stop sequences, log-probabilities and penalties.
    """

    seed: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    stop_token_ids: Iterable[int]
    controls: GenerationControls | None
