"""Every conversion between the SDK's values and the `kakeya.v1` messages, and the client-side checks of what the
wire cannot carry (meaningful limits are the server's to check)."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable

from kakeya._generated import runtime_pb2 as pb
from kakeya.errors import InvalidArgument, ProtocolError
from kakeya.types import (
    GenerationControls,
    GenerationStats,
    KvCompressor,
    KvStrategy,
    ModelInfo,
    ServerLimits,
    SessionInfo,
    StopReason,
    TokenLogprobs,
)

_UINT32 = 1 << 32
_UINT64 = 1 << 64

_STRATEGY_ENUMS = {
    KvStrategy.FULL: pb.KV_STRATEGY_FULL,
    KvStrategy.SINK_WINDOW: pb.KV_STRATEGY_SINK_WINDOW,
    KvStrategy.DLM_RESTORE: pb.KV_STRATEGY_DLM_RESTORE,
}
_STRATEGIES = {value: strategy for strategy, value in _STRATEGY_ENUMS.items()}
_COMPRESSOR_ENUMS = {
    KvCompressor.NONE: pb.KV_COMPRESSOR_NONE,
    KvCompressor.KAKEYA_D4: pb.KV_COMPRESSOR_KAKEYA_D4,
    KvCompressor.KAKEYA_E8: pb.KV_COMPRESSOR_KAKEYA_E8,
    KvCompressor.KAKEYA_D4S: pb.KV_COMPRESSOR_KAKEYA_D4S,
    KvCompressor.KAKEYA_E8S: pb.KV_COMPRESSOR_KAKEYA_E8S,
}
_COMPRESSORS = {value: compressor for compressor, value in _COMPRESSOR_ENUMS.items()}
_STOP_REASONS = {
    pb.STOP_REASON_MAX_TOKENS: StopReason.MAX_TOKENS,
    pb.STOP_REASON_EOS: StopReason.EOS,
    pb.STOP_REASON_CANCELLED: StopReason.CANCELLED,
    pb.STOP_REASON_TRUNCATED: StopReason.TRUNCATED,
    pb.STOP_REASON_STOP_SEQUENCE: StopReason.STOP_SEQUENCE,
    pb.STOP_REASON_GRAMMAR_DEAD_END: StopReason.GRAMMAR_DEAD_END,
}


def _integer(value: object, what: str, bound: int) -> int:
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an integer, got {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(f"{what} must be an integer, got {value!r}") from None
    if not 0 <= number < bound:
        raise InvalidArgument(f"{what} must be in [0, {bound}), got {number}")
    return number


def uint32(value: object, what: str) -> int:
    return _integer(value, what, _UINT32)


def fork_request(session_id: str, prefix_tokens: int | None, label: str | None) -> pb.ForkSessionRequest:
    """A `ForkSessionRequest`; unset fields keep the parent's whole history and its label."""
    request = pb.ForkSessionRequest(session_id=session_id)
    if prefix_tokens is not None:
        request.prefix_tokens = _integer(prefix_tokens, "prefix_tokens", 2**64 - 1)
    if label is not None:
        if not isinstance(label, str):
            raise InvalidArgument(f"label must be a string, got {label!r}")
        request.client_label = label
    return request


def token_ids(values: Iterable[object], what: str) -> list[int]:
    """Token ids as unsigned 32-bit integers; a str or bytes is refused (it is text, not tokens)."""
    if isinstance(values, (str, bytes)):
        raise InvalidArgument(f"{what} must be token ids, got text {values!r}")
    return [uint32(value, f"{what}[{index}]") for index, value in enumerate(values)]


def _optional_float(value: float | None, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{what} must be a number, got {value!r}")
    if math.isfinite(value) and abs(value) > 3.4e38:
        raise InvalidArgument(f"{what} {value} does not fit a 32-bit float")
    return float(value)


def check_timeout(value: float | None, what: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise InvalidArgument(f"{what} must be a number > 0 or None, got {value!r}")


def strategy(value: KvStrategy | str | None) -> int:
    if value is None:
        return pb.KV_STRATEGY_UNSPECIFIED
    try:
        return _STRATEGY_ENUMS[KvStrategy(value)]
    except ValueError:
        names = ", ".join(s.value for s in KvStrategy)
        raise InvalidArgument(f"unknown KV strategy {value!r}; expected one of {names}") from None


def compressor(value: KvCompressor | str | None) -> int:
    if value is None:
        return pb.KV_COMPRESSOR_UNSPECIFIED
    try:
        return _COMPRESSOR_ENUMS[KvCompressor(value)]
    except ValueError:
        names = ", ".join(c.value for c in KvCompressor)
        raise InvalidArgument(f"unknown KV compressor {value!r}; expected one of {names}") from None


def create_request(
    *,
    label: str = "",
    eos_token_ids: Iterable[int] | None = None,
    initial_tokens: Iterable[int] = (),
    kv_strategy: KvStrategy | str | None = None,
    sink_tokens: int | None = None,
    window_tokens: int | None = None,
    kv_compressor: KvCompressor | str | None = None,
    kv_q_range: int | None = None,
) -> pb.CreateSessionRequest:
    """A `CreateSessionRequest` from the settings of `create_session` (`SessionSettings`), checked."""
    if not isinstance(label, str):
        raise InvalidArgument(f"label must be a string, got {label!r}")
    eos = None if eos_token_ids is None else token_ids(eos_token_ids, "eos_token_ids")
    request = pb.CreateSessionRequest(
        client_label=label,
        eos_token_ids=eos or [],
        # None takes the model's EOS ids; an empty list asks for none at all.
        no_default_eos=eos is not None and not eos,
        initial_token_ids=token_ids(initial_tokens, "initial_tokens"),
        kv_strategy=strategy(kv_strategy),  # type: ignore[arg-type]
        kv_compressor=compressor(kv_compressor),  # type: ignore[arg-type]
    )
    if kv_q_range is not None:
        request.kv_q_range = uint32(kv_q_range, "kv_q_range")
    if sink_tokens is not None:
        request.sink_tokens = uint32(sink_tokens, "sink_tokens")
    if window_tokens is not None:
        request.window_tokens = uint32(window_tokens, "window_tokens")
    return request


def generate_fields(
    *,
    max_tokens: int,
    max_generate_tokens: int | None = None,
    seed: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    stop_token_ids: Iterable[int] = (),
    controls: GenerationControls | None = None,
) -> dict[str, object]:
    """The fields shared by `GenerateRequest` and `GenerateCommand`, checked; unset ones are left out.

    `max_tokens` must be in 1..`max_generate_tokens` (the server's limit, when known)."""
    fields: dict[str, object] = {
        "max_tokens": _max_tokens(max_tokens, max_generate_tokens),
        "stop_token_ids": token_ids(stop_token_ids, "stop_token_ids"),
    }
    if seed is not None:
        fields["seed"] = _integer(seed, "seed", _UINT64)
    if (value := _optional_float(temperature, "temperature")) is not None:
        fields["temperature"] = value
    if (value := _optional_float(top_p, "top_p")) is not None:
        fields["top_p"] = value
    if top_k is not None:
        fields["top_k"] = uint32(top_k, "top_k")
    if controls is not None:
        fields.update(_control_fields(controls))
    return fields


def _max_tokens(value: object, limit: int | None) -> int:
    """`max_tokens` within 1..the server's limit; without the limit, within what the wire carries."""
    if isinstance(value, bool):
        raise InvalidArgument(f"max_tokens must be an integer, got {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(f"max_tokens must be an integer, got {value!r}") from None
    upper = limit if limit is not None else _UINT32 - 1
    if not 1 <= number <= upper:
        bound = f"1..{limit} (the server's limit)" if limit is not None else f"1..{upper}"
        raise InvalidArgument(f"max_tokens must be in {bound}, got {number}")
    return number


def model_info(reply: pb.GetModelInfoResponse) -> ModelInfo:
    limits = reply.limits
    return ModelInfo(
        vocab_size=reply.vocab_size,
        eos_token_ids=tuple(reply.eos_token_ids),
        trained_context_tokens=reply.trained_context_tokens,
        backend=reply.backend,
        model_name=reply.model_name,
        description=reply.description,
        chat_template=reply.chat_template if reply.HasField("chat_template") else None,
        default_kv_strategy=_STRATEGIES.get(reply.default_kv_strategy),
        default_sink_tokens=reply.default_sink_tokens,
        default_window_tokens=reply.default_window_tokens,
        limits=ServerLimits(
            max_generate_tokens=limits.max_generate_tokens,
            max_append_tokens=limits.max_append_tokens,
            max_history_tokens=limits.max_history_tokens,
            max_sessions=limits.max_sessions,
            max_message_bytes=limits.max_message_bytes,
            max_concurrent_generations=limits.max_concurrent_generations,
            queue_deadline_s=limits.queue_deadline_seconds,
            max_batch_size=limits.max_batch_size,
            prefill_chunk_tokens=limits.prefill_chunk_tokens,
        ),
        proposer=reply.proposer,
        server_version=reply.server_version,
    )


def _control_fields(controls: GenerationControls) -> dict[str, object]:
    fields: dict[str, object] = {
        "stop_sequences": [
            pb.StopSequence(token_ids=token_ids(s, f"stop_sequences[{i}]"))
            for i, s in enumerate(controls.stop_sequences)
        ],
        "logprobs": bool(controls.logprobs),
        "top_logprobs": uint32(controls.top_logprobs, "top_logprobs"),
    }
    grammar = controls.grammar
    if grammar is not None:
        if grammar.kind not in ("json_schema", "regex", "lark", "gbnf"):
            raise InvalidArgument(f"unknown grammar kind {grammar.kind!r}")
        fields["grammar"] = pb.GrammarConstraint(**{grammar.kind: grammar.source})
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p"):
        if (value := _optional_float(getattr(controls, name), name)) is not None:
            fields[name] = value
    if controls.penalty_window_tokens is not None:
        fields["penalty_window_tokens"] = uint32(controls.penalty_window_tokens, "penalty_window_tokens")
    return fields


def token_logprobs(scored: pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=scored.token_id,
        logprob=scored.logprob,
        top_logprobs=tuple((a.token_id, a.logprob) for a in scored.top_logprobs),
    )


def generation_stats(done: pb.GenerateDone, truncated_token_count: int) -> GenerationStats:
    if done.stop_reason not in _STOP_REASONS:
        raise ProtocolError(f"the server sent an unknown stop reason {done.stop_reason}")
    return GenerationStats(
        stop_reason=_STOP_REASONS[done.stop_reason],
        generated_token_count=done.generated_token_count,
        prefill_token_count=done.prefill_token_count,
        prefill_duration_s=done.prefill_duration_seconds,
        total_duration_s=done.total_duration_seconds,
        time_to_first_token_s=done.time_to_first_token_seconds,
        draft_token_count=done.draft_token_count,
        accepted_draft_token_count=done.accepted_draft_token_count,
        verifier_forward_count=done.verifier_forward_count,
        truncated_token_count=truncated_token_count,
        stop_sequence_index=done.stop_sequence_index if done.HasField("stop_sequence_index") else None,
    )


def abandoned_stats(received: int, truncated_token_count: int) -> GenerationStats:
    """What the client knows of a generation it stopped reading before the server's final message."""
    return GenerationStats(
        stop_reason=StopReason.CANCELLED,
        generated_token_count=received,
        truncated_token_count=truncated_token_count,
        server_reported=False,
    )


def session_info(reply: pb.GetSessionInfoResponse) -> SessionInfo:
    return SessionInfo(
        history_length=reply.history_length,
        kv_live_bytes=reply.kv_live_bytes,
        inv1_violations=reply.cache_invariant_inv1_violations,
        inv2_violations=reply.cache_invariant_inv2_violations,
        idle_s=reply.idle_seconds,
        kv_strategy=_STRATEGIES.get(reply.kv_strategy),
        resident_token_count=reply.resident_token_count,
        kv_compressed_bytes=reply.kv_compressed_bytes,
        pending_token_count=reply.pending_token_count,
        evicted_token_count=reply.evicted_token_count,
        label=reply.client_label,
        generating=reply.generating,
        sink_tokens=reply.sink_tokens,
        window_tokens=reply.window_tokens,
        history_tail=tuple(reply.history_tail_token_ids),
        kv_compressor=_COMPRESSORS.get(reply.kv_compressor),
        kv_q_range=reply.kv_q_range,
        kv_dense_equivalent_bytes=reply.kv_dense_equivalent_bytes,
        kv_escaped_blocks=reply.kv_escaped_blocks,
        restored_token_count=reply.restored_token_count,
        kv_resident_bytes=reply.kv_resident_bytes,
        kv_restored_bytes=reply.kv_restored_bytes,
        kv_restoration_state_bytes=reply.kv_restoration_state_bytes,
        kv_peak_restored_bytes=reply.kv_peak_restored_bytes,
        history_token_bytes=reply.history_token_bytes,
        kv_peak_bytes=reply.kv_peak_bytes,
        draft_state_bytes=reply.draft_state_bytes,
    )
