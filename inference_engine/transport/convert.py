"""Every proto <-> domain conversion of the gRPC transport, and the error -> status mapping."""

from __future__ import annotations

import grpc

from inference_engine.domain import (
    CreateParams,
    DoneEvent,
    GenerateEvent,
    GenerateParams,
    GenerationStats,
    ModelInfo,
    SessionInfo,
    StopReason,
    TokenEvent,
    TruncatedEvent,
)
from inference_engine.errors import InvalidArgument, Status
from inference_engine.generated import runtime_pb2 as pb
from kv_cache_proposer.controls import TokenLogprob
from kv_cache_proposer.grammar import GrammarKind, GrammarSpec

STATUS_CODES = {status: getattr(grpc.StatusCode, status.value) for status in Status}

_STRATEGY_NAMES = {
    pb.KV_STRATEGY_UNSPECIFIED: None,
    pb.KV_STRATEGY_FULL: "full",
    pb.KV_STRATEGY_SINK_WINDOW: "sink_window",
    pb.KV_STRATEGY_DLM_RESTORE: "dlm_restore",
}
_STRATEGY_ENUMS = {name: value for value, name in _STRATEGY_NAMES.items() if name}

_COMPRESSOR_NAMES = {
    pb.KV_COMPRESSOR_UNSPECIFIED: None,
    pb.KV_COMPRESSOR_NONE: "none",
    pb.KV_COMPRESSOR_KAKEYA_D4: "kakeya_d4",
    pb.KV_COMPRESSOR_KAKEYA_E8: "kakeya_e8",
    pb.KV_COMPRESSOR_KAKEYA_D4S: "kakeya_d4s",
    pb.KV_COMPRESSOR_KAKEYA_E8S: "kakeya_e8s",
}
_COMPRESSOR_ENUMS = {name: value for value, name in _COMPRESSOR_NAMES.items() if name}

_STOP_REASONS = {
    StopReason.MAX_TOKENS: pb.STOP_REASON_MAX_TOKENS,
    StopReason.EOS: pb.STOP_REASON_EOS,
    StopReason.CANCELLED: pb.STOP_REASON_CANCELLED,
    StopReason.TRUNCATED: pb.STOP_REASON_TRUNCATED,
    StopReason.STOP_SEQUENCE: pb.STOP_REASON_STOP_SEQUENCE,
    StopReason.GRAMMAR_DEAD_END: pb.STOP_REASON_GRAMMAR_DEAD_END,
}


def create_params(request: pb.CreateSessionRequest) -> CreateParams:
    if request.kv_strategy not in _STRATEGY_NAMES:
        raise InvalidArgument(f"unknown kv_strategy enum value {request.kv_strategy}")
    if request.kv_compressor not in _COMPRESSOR_NAMES:
        raise InvalidArgument(f"unknown kv_compressor enum value {request.kv_compressor}")
    return CreateParams(
        label=request.client_label,
        eos_token_ids=tuple(request.eos_token_ids),
        initial_token_ids=tuple(request.initial_token_ids),
        kv_strategy=_STRATEGY_NAMES[request.kv_strategy],
        sink=request.sink_tokens if request.HasField("sink_tokens") else None,
        window=request.window_tokens if request.HasField("window_tokens") else None,
        no_default_eos=request.no_default_eos,
        kv_compressor=_COMPRESSOR_NAMES[request.kv_compressor],
        kv_q_range=request.kv_q_range if request.HasField("kv_q_range") else None,
    )


def generate_params(request: pb.GenerateRequest | pb.GenerateCommand) -> GenerateParams:
    return GenerateParams(
        max_tokens=request.max_tokens,
        seed=request.seed if request.HasField("seed") else None,
        temperature=request.temperature if request.HasField("temperature") else None,
        top_p=request.top_p if request.HasField("top_p") else None,
        top_k=request.top_k if request.HasField("top_k") else None,
        stop_token_ids=tuple(request.stop_token_ids),
        grammar=_grammar(request.grammar) if request.HasField("grammar") else None,
        stop_sequences=tuple(tuple(stop.token_ids) for stop in request.stop_sequences),
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
        repetition_penalty=request.repetition_penalty if request.HasField("repetition_penalty") else None,
        presence_penalty=request.presence_penalty if request.HasField("presence_penalty") else None,
        frequency_penalty=request.frequency_penalty if request.HasField("frequency_penalty") else None,
        penalty_window_tokens=request.penalty_window_tokens if request.HasField("penalty_window_tokens") else None,
        min_p=request.min_p if request.HasField("min_p") else None,
    )


def _grammar(grammar: pb.GrammarConstraint) -> GrammarSpec:
    kind = grammar.WhichOneof("grammar")
    if kind is None:
        raise InvalidArgument("grammar must set one of json_schema, regex, lark or gbnf")
    return GrammarSpec(GrammarKind(kind), getattr(grammar, kind))


def _scored_token(scored: TokenLogprob) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        token_id=scored.token_id,
        logprob=scored.logprob,
        top_logprobs=[pb.LogprobAlternative(token_id=t, logprob=lp) for t, lp in scored.top],
    )


def generate_done(stats: GenerationStats) -> pb.GenerateDone:
    return pb.GenerateDone(
        stop_reason=_STOP_REASONS[stats.stop_reason],
        generated_token_count=stats.generated_token_count,
        prefill_duration_seconds=stats.prefill_duration_s,
        total_duration_seconds=stats.total_duration_s,
        prefill_token_count=stats.prefill_token_count,
        draft_token_count=stats.draft_token_count,
        accepted_draft_token_count=stats.accepted_draft_token_count,
        verifier_forward_count=stats.verifier_forward_count,
        time_to_first_token_seconds=stats.time_to_first_token_s,
        stop_sequence_index=stats.stop_sequence_index,
    )


def generate_response(event: GenerateEvent) -> pb.GenerateResponse:
    if isinstance(event, TokenEvent):
        if event.logprobs is not None:
            return pb.GenerateResponse(scored_token=_scored_token(event.logprobs))
        return pb.GenerateResponse(token_id=event.token_id)
    if isinstance(event, TruncatedEvent):
        return pb.GenerateResponse(truncated=pb.HistoryTruncated(dropped_token_count=event.dropped_token_count))
    return pb.GenerateResponse(done=generate_done(event.stats))


def converse_response(command_id: int, event: GenerateEvent) -> pb.ConverseResponse:
    if isinstance(event, TokenEvent):
        if event.logprobs is not None:
            return pb.ConverseResponse(command_id=command_id, scored_token=_scored_token(event.logprobs))
        return pb.ConverseResponse(command_id=command_id, token_id=event.token_id)
    if isinstance(event, TruncatedEvent):
        truncated = pb.HistoryTruncated(dropped_token_count=event.dropped_token_count)
        return pb.ConverseResponse(command_id=command_id, truncated=truncated)
    assert isinstance(event, DoneEvent)
    return pb.ConverseResponse(command_id=command_id, done=generate_done(event.stats))


def session_info(info: SessionInfo) -> pb.GetSessionInfoResponse:
    return pb.GetSessionInfoResponse(
        history_length=info.history_length,
        kv_live_bytes=info.kv_live_bytes,
        cache_invariant_inv1_violations=info.invariant_violations.get("inv1", 0),
        cache_invariant_inv2_violations=info.invariant_violations.get("inv2", 0),
        idle_seconds=info.idle_seconds,
        kv_strategy=_STRATEGY_ENUMS.get(info.kv_strategy, pb.KV_STRATEGY_UNSPECIFIED),
        resident_token_count=info.resident_token_count,
        kv_compressed_bytes=info.kv_compressed_bytes,
        pending_token_count=info.pending_token_count,
        evicted_token_count=info.evicted_token_count,
        client_label=info.client_label,
        generating=info.generating,
        sink_tokens=info.sink_tokens,
        window_tokens=info.window_tokens,
        history_tail_token_ids=info.history_tail,
        kv_compressor=_COMPRESSOR_ENUMS.get(info.kv_compressor, pb.KV_COMPRESSOR_UNSPECIFIED),
        kv_q_range=info.kv_q_range,
        kv_dense_equivalent_bytes=info.kv_dense_equivalent_bytes,
        kv_escaped_blocks=info.kv_escaped_blocks,
        restored_token_count=info.restored_token_count,
        kv_resident_bytes=info.kv_resident_bytes,
        kv_restored_bytes=info.kv_restored_bytes,
        kv_restoration_state_bytes=info.kv_restoration_state_bytes,
        kv_peak_restored_bytes=info.kv_peak_restored_bytes,
        history_token_bytes=info.history_token_bytes,
        kv_peak_bytes=info.kv_peak_bytes,
        draft_state_bytes=info.draft_state_bytes,
    )


def model_info(info: ModelInfo) -> pb.GetModelInfoResponse:
    limits = info.limits
    return pb.GetModelInfoResponse(
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        trained_context_tokens=info.trained_context_tokens,
        backend=info.backend,
        model_name=info.model_name,
        description=info.description,
        chat_template=info.chat_template,
        default_kv_strategy=_STRATEGY_ENUMS.get(info.default_kv_strategy, pb.KV_STRATEGY_UNSPECIFIED),
        default_sink_tokens=info.default_sink_tokens,
        default_window_tokens=info.default_window_tokens,
        limits=pb.ServerLimits(
            max_generate_tokens=limits.max_generate_tokens,
            max_append_tokens=limits.max_append_tokens,
            max_history_tokens=limits.max_history_tokens,
            max_sessions=limits.max_sessions,
            max_message_bytes=limits.max_message_bytes,
            max_concurrent_generations=limits.max_concurrent_generations,
            queue_deadline_seconds=limits.queue_deadline_s,
            max_batch_size=limits.max_batch_size,
            prefill_chunk_tokens=limits.prefill_chunk_tokens,
        ),
        proposer=info.proposer,
        server_version=info.server_version,
    )
