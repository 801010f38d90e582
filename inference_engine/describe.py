"""What GetSessionInfo and GetModelInfo report: a session's counters, and the served model with the server's
defaults and limits."""

from __future__ import annotations

from inference_engine import __version__
from inference_engine.config import ServerConfig
from inference_engine.domain import ModelInfo, ServerLimits, SessionInfo
from inference_engine.model_dir_info import ModelDirInfo
from inference_engine.restoration import restoration_info
from inference_engine.sessions import Session
from kv_cache_proposer.strategies import KVStrategy, strategy_options
from kv_cache_proposer.verifier import Verifier


def describe_session(session: Session, history_tail_tokens: int, *, idle_seconds: float) -> SessionInfo:
    """A session's counters, with its last `history_tail_tokens` history tokens."""
    tokens = session.seq.tokens
    cache = session.seq.cache
    held = cache.footprint()
    strategy = cache.strategy
    options = strategy_options(strategy)
    return SessionInfo(
        history_length=len(tokens),
        kv_live_bytes=session.kv_bytes,
        kv_peak_bytes=max(session.kv_peak_bytes, session.kv_bytes),
        draft_state_bytes=session.draft_bytes,
        idle_seconds=max(0.0, idle_seconds),
        kv_strategy=strategy.name,
        resident_token_count=held.resident_count,
        kv_compressed_bytes=held.compressed_bytes,
        pending_token_count=session.seq.pending_count,
        evicted_token_count=held.evicted_count,
        client_label=session.label,
        generating=session.generating,
        sink_tokens=options.get("sink", 0),
        window_tokens=options.get("window", 0),
        invariant_violations=dict(session.invariant_violations),
        history_tail=tuple(tokens[max(0, len(tokens) - history_tail_tokens) :]) if history_tail_tokens else (),
        kv_compressor=session.compressor.name,
        kv_q_range=session.compressor.q_range if session.compressor.lattice else 0,
        kv_dense_equivalent_bytes=held.dense_equivalent_bytes,
        kv_escaped_blocks=held.escaped_vectors,
        **restoration_info(held),
    )


def describe_model(
    config: ServerConfig,
    verifier: Verifier,
    model_dir_info: ModelDirInfo,
    *,
    eos_token_ids: tuple[int, ...],
    default_strategy: KVStrategy,
    prefill_chunk_tokens: int,
    max_batch_size: int,
    proposer: str,
) -> ModelInfo:
    """The served model's facts, the session defaults and the request limits."""
    return ModelInfo(
        vocab_size=verifier.vocab_size,
        eos_token_ids=eos_token_ids,
        trained_context_tokens=model_dir_info.trained_context_tokens,
        backend=config.backend,
        model_name=model_dir_info.name,
        description=verifier.description,
        chat_template=model_dir_info.chat_template,
        default_kv_strategy=default_strategy.name,
        default_sink_tokens=config.sink,
        default_window_tokens=config.window,
        limits=ServerLimits(
            max_generate_tokens=config.max_generate_tokens,
            max_append_tokens=config.max_append_tokens,
            max_history_tokens=config.max_history_tokens,
            max_sessions=config.max_sessions,
            max_message_bytes=config.max_message_bytes,
            max_concurrent_generations=config.max_concurrent,
            queue_deadline_s=config.queue_deadline_s,
            max_batch_size=max_batch_size,
            prefill_chunk_tokens=prefill_chunk_tokens,
        ),
        proposer=proposer,
        server_version=__version__,
    )
