"""The session service: creates sessions, appends tokens, runs generations on the engine loop, frees memory.

Transport-neutral: the gRPC servicer (and the HTTP shim) call these coroutines and convert what they return.
Everything here runs on the event loop; tensor work runs on the engine loop's thread (`EngineLoop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Iterable
from pathlib import Path
from typing import Any

from inference_engine import __version__
from inference_engine.admission import Admission
from inference_engine.cluster import ClusterMetrics
from inference_engine.config import ServerConfig
from inference_engine.describe import describe_model, describe_session
from inference_engine.domain import (
    CreateParams,
    DoneEvent,
    GenerateEvent,
    GenerateParams,
    ModelInfo,
    SessionInfo,
    TokenEvent,
    TruncatedEvent,
)
from inference_engine.durability import SessionJournal
from inference_engine.durable_kv import DurableKV
from inference_engine.engine import EngineLoop
from inference_engine.errors import (
    InvalidArgument,
    JournalUnavailable,
    ResourceExhausted,
    SessionFailed,
    ShuttingDown,
)
from inference_engine.forking import fork_sequence
from inference_engine.grammars import ModelGrammars
from inference_engine.journal import Journal, JournalAppended, SessionRecord
from inference_engine.memory import release_free_memory
from inference_engine.metrics import Metrics
from inference_engine.model_dir_info import ModelDirInfo
from inference_engine.restoration import restoration_setup
from inference_engine.sessions import Session, SessionStore
from inference_engine.streaming import GenerationStreams
from inference_engine.validation import RequestChecks
from kv_cache_proposer.compression import KVCompressor, compressor_layer_store
from kv_cache_proposer.decoding import Decoder, DraftPolicy, GenerationBudget, SequenceState
from kv_cache_proposer.proposers.base import NoProposer, Proposer
from kv_cache_proposer.strategies import KVStrategy
from kv_cache_proposer.verifier import Verifier

log = logging.getLogger(__name__)


class Runtime:
    """Sessions bound to one loaded verifier, journaled once a journal is attached (`SessionJournal`)."""

    def __init__(
        self,
        verifier: Verifier,
        config: ServerConfig,
        metrics: Metrics,
        *,
        proposer: Proposer | None = None,
        model_dir_info: ModelDirInfo | None = None,
    ) -> None:
        """`model_dir_info` defaults to what `config.model_dir` says; pass it when the verifier was loaded from
        another directory."""
        self.verifier = verifier
        self.config = config
        self.metrics = metrics
        self.proposer = proposer or NoProposer()
        self.checks = RequestChecks(config, verifier.vocab_size)
        self.model_dir_info = model_dir_info or ModelDirInfo.read(config.model_dir)
        self.default_eos_token_ids = self.model_dir_info.eos_within(verifier.vocab_size)
        metrics.build_info.labels(
            version=__version__,
            backend=config.backend,
            model=self.model_dir_info.name,
            proposer=self.proposer.name,
            kv_strategy=config.kv_strategy,
        ).set(1)
        self.decoder = Decoder(
            verifier,
            prefill_chunk_tokens=config.prefill_chunk_tokens or None,
            burst_tokens=config.decode_burst_tokens or None,
            draft_policy=(
                self.proposer.draft_policy if config.draft_policy == "auto" else DraftPolicy(config.draft_policy)
            ),
        )
        self.engine = EngineLoop(
            self.decoder,
            metrics,
            max_batch_size=config.max_batch_size or verifier.batch_size,
            token_budget=self.decoder.prefill_chunk_tokens,
            gather_s=config.batch_wait_ms / 1000,
        )
        self.store = SessionStore(
            max_sessions=config.max_sessions,
            idle_ttl_s=config.session_idle_ttl_s,
            kv_budget_bytes=config.kv_budget_bytes,
            metrics=metrics,
        )
        self.admission = Admission(max_concurrent=config.max_concurrent, queue_deadline_s=config.queue_deadline_s)
        self._accepting = True
        self._cancelling = False  # set once shutdown cancels: queued generations then end before they start
        self._generations_in_flight = 0  # running or queued
        self.sessions_journal = SessionJournal(
            config, self.checks, self.store, verifier.vocab_size, ClusterMetrics(metrics.registry), self._open_session
        )
        self.streams = GenerationStreams(
            self.engine,
            self.store,
            self.admission,
            self.sessions_journal,
            metrics,
            resting_sessions=config.kv_resting_sessions,
        )
        self.grammars = ModelGrammars(config.model_dir, verifier.vocab_size, cache_size=config.grammar_cache_size)
        self.restoration = restoration_setup(config, verifier.num_layers, self.model_dir_info.restore_plan)

    # -- requests ----------------------------------------------------------------------------------------------
    async def create_session(self, params: CreateParams) -> tuple[str, int]:
        """Allocate a session; returns (session id, history length)."""
        self._check_accepting()
        strategy = self.checks.strategy(params)
        compressor = self.checks.compressor(params)
        eos = self.checks.tokens(params.eos_token_ids, "eos_token_ids")
        if not eos and not params.no_default_eos:
            eos = list(self.default_eos_token_ids)
        initial = self.checks.append(0, params.initial_token_ids, "initial_token_ids")
        session = self._open_session(
            self.store.new_id(), params.label, eos, strategy, initial, self.store.now(), compressor
        )
        session.single_shot = params.single_shot
        await self.sessions_journal.opened(session)
        log.info(
            "session created",
            extra={
                "session_id": session.session_id,
                "label": params.label,
                "strategy": strategy.name,
                "kv_compressor": compressor.name,
            },
        )
        return session.session_id, len(session.seq.tokens)

    async def append(self, session_id: str, token_ids: Iterable[int]) -> int:
        """Append tokens to a session's history (pending until the next generation); returns the history length."""
        self._check_accepting()
        session = await self.acquire(session_id)
        async with self.admission.session_turn(session):
            tokens = self.checks.append(len(session.seq.tokens), token_ids, "token_ids")
            await self.sessions_journal.write(JournalAppended(session_id, tuple(tokens), time.time()))
            session.seq.tokens.extend(tokens)
            return len(session.seq.tokens)

    async def generate(
        self, session_id: str, params: GenerateParams, cancel: asyncio.Event | None = None
    ) -> AsyncGenerator[GenerateEvent, None]:
        """Run one generation, yielding token events and a final `DoneEvent`.

        Setting `cancel` stops the generation after its current step with stop reason CANCELLED.
        """
        self._check_accepting()
        sampling, budget_stops = self.checks.generate(params)
        controls = self.checks.controls(params)
        if params.grammar is not None:
            controls.grammar, grammar_stops = await asyncio.to_thread(self.grammars.start, params.grammar)
            budget_stops |= grammar_stops
        session = await self.acquire(session_id)
        self._generations_in_flight += 1
        outcome = "cancelled"  # unless the generation ends otherwise, the client went away mid-stream
        streams, metrics = self.streams, self.metrics
        try:
            async with streams.turn(session):
                budget = self._budget(session, params, budget_stops)
                async with streams.running(session, sampling, budget, controls, cancel) as generation:
                    last_token_at: float | None = None
                    while True:
                        output = await generation.next_output()
                        try:
                            await streams.take(session, generation, output)
                        except (SessionFailed, JournalUnavailable):
                            outcome = "failed"
                            raise
                        if output.truncated:
                            yield TruncatedEvent(output.truncated)
                        logprobs = output.logprobs
                        for index, token in enumerate(output.tokens):
                            now = time.perf_counter()
                            if last_token_at is not None:
                                metrics.generate_inter_token_latency_seconds.observe(now - last_token_at)
                            last_token_at = now
                            yield TokenEvent(token, logprobs[index] if logprobs is not None else None)
                        if not streams.within_budget(session):
                            outcome = "resource_exhausted"
                            raise ResourceExhausted(
                                f"running sessions hold {self.store.kv_live_bytes()} KV bytes, over --kv-budget-bytes "
                                f"{self.config.kv_budget_bytes}, and no idle session is left to evict"
                            )
                        if output.done is not None:
                            outcome = output.done.stop_reason.value
                            session.finishing = True  # the client may describe the session once it reads Done
                            yield DoneEvent(output.done)
                            return
        finally:
            self._generations_in_flight -= 1
            metrics.generate_requests.labels(outcome=outcome).inc()

    def _budget(self, session: Session, params: GenerateParams, stops: frozenset[int]) -> GenerationBudget:
        """The limits of a generation on a session that holds its turn (`RequestChecks.budget`); refused while
        shutting down."""
        if self._cancelling:
            raise ShuttingDown("the server shut down before this generation started")
        return self.checks.budget(len(session.seq.tokens), params, session.eos_token_ids | stops)

    async def fork_session(
        self, session_id: str, prefix_tokens: int | None = None, label: str | None = None
    ) -> tuple[str, int, int]:
        """Create a session whose history is the parent's first `prefix_tokens` tokens (all when None) and whose
        caches start as copies of the parent's. Waits for the parent's turn. Returns (fork id, history length,
        positions whose K/V were copied)."""
        self._check_accepting()
        parent = await self.acquire(session_id)
        async with self.admission.session_turn(parent):
            history = len(parent.seq.tokens)
            length = history if prefix_tokens is None else prefix_tokens
            if not 0 <= length <= history:
                raise InvalidArgument(f"prefix_tokens {length} is outside the parent's history of {history} tokens")
            seq = await self.engine.call(fork_sequence, parent.seq, length)
            fork = parent.fork(self.store.new_id(), seq, self.store.now(), label)
            try:
                self.store.add(fork)
            except ResourceExhausted:
                fork.release()
                raise
            await self.sessions_journal.opened(fork)
        log.info(
            "session forked",
            extra={"session_id": fork.session_id, "parent": session_id, "history": length, "copied": seq.committed},
        )
        return fork.session_id, length, seq.committed

    async def close_session(self, session_id: str) -> int:
        """Close a session: a running generation is cancelled, then its memory is freed. Returns the final
        history length."""
        session = await self.acquire(session_id, touch=False)
        self.store.detach(session, "closed", "closed")
        if session.cancel is not None:
            session.cancel.set()
        async with session.lock:
            session.release()
        self.store.refresh_gauges()
        with contextlib.suppress(ShuttingDown):
            await self.engine.call(release_free_memory)
        if self.journal is not None:
            await self.journal.flush()  # the close is durable once acknowledged
        log.info("session closed", extra={"session_id": session_id, "history_length": len(session.seq.tokens)})
        return len(session.seq.tokens)

    async def settle_cancellations(self, session_id: str, window_s: float = 0.025) -> None:
        """Let a cancellation sent just before this call end the session's generation before it is described.

        A client that cancels a stream and then asks for the session's state sends both on one connection, but the
        cancel can reach the generation's task after the question: without this wait, the answer could still say
        `generating` for a generation the client has already cancelled. A running generation delays the answer by
        at most `window_s`; a cancelled one ends after its current step. A generation that sent its Done delays it
        until its session has parked, so the answer never shows the storage of a generation the client saw end.
        """
        await self.streams.settle_cancellations(session_id, window_s=window_s, timeout_s=self.config.queue_deadline_s)

    def session_info(self, session_id: str, history_tail_tokens: int = 0) -> SessionInfo:
        """Describe a session without counting as an access; optionally include the last history tokens."""
        if history_tail_tokens > self.config.max_append_tokens:
            raise InvalidArgument(
                f"history_tail_tokens {history_tail_tokens} is above the limit {self.config.max_append_tokens}"
            )
        session = self.store.get(session_id, touch=False)
        return describe_session(session, history_tail_tokens, idle_seconds=self.store.now() - session.last_access)

    def model_info(self) -> ModelInfo:
        """The served model's facts, the session defaults and the request limits."""
        return describe_model(
            self.config,
            self.verifier,
            self.model_dir_info,
            eos_token_ids=self.default_eos_token_ids,
            default_strategy=self.checks.default_strategy,
            prefill_chunk_tokens=self.decoder.prefill_chunk_tokens,
            max_batch_size=self.engine.max_batch_size,
            proposer=self.proposer.name,
        )

    # -- the journal -----------------------------------------------------------------------------------------------
    @property
    def journal(self) -> Journal | None:
        return self.sessions_journal.journal

    def journal_identity(self) -> dict[str, Any]:
        """What a session snapshot must match to be restored into this runtime."""
        return self.sessions_journal.identity()

    def attach_journal(self, journal: Journal) -> None:
        """Record every session change in `journal` from now on (`SessionJournal.attach`)."""
        self.sessions_journal.attach(journal)
        self.engine.journal = journal

    def keep_kv(self, directory: Path) -> None:
        """Keep the K/V of parked sessions in files under `directory`, read back by sessions restored from then on
        (`DurableKV`)."""
        identity = {**self.journal_identity(), "verifier": self.verifier.description}
        kv = DurableKV(directory, self.verifier, identity, max_bytes=self.config.state_kv_max_bytes)
        self.metrics.session_kv_file_bytes.set_function(lambda: kv.total_bytes)
        self.sessions_journal.keep_kv(kv)

    def restore_sessions(self, records: list[SessionRecord], *, drop_invalid: bool = False) -> list[str]:
        """Bring journaled sessions back under their ids, with their whole history pending
        (`SessionJournal.restore_all`); returns what was dropped."""
        return self.sessions_journal.restore_all(records, drop_invalid=drop_invalid)

    async def acquire(self, session_id: str, *, touch: bool = True) -> Session:
        """The session with this id: held here, or (with a shared journal) taken over from it; else `NOT_FOUND`."""
        return await self.sessions_journal.acquire(session_id, touch=touch)

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def evict_idle(self) -> int:
        return self.store.evict_idle()

    @property
    def active_generations(self) -> int:
        """Generations running or queued for their turn."""
        return self._generations_in_flight

    @property
    def accepting(self) -> bool:
        """Whether new calls are taken (False once shutdown began)."""
        return self._accepting

    def stop_accepting(self) -> None:
        self._accepting = False

    def cancel_all(self) -> None:
        """Ask every running generation to stop after its current step; queued ones end as they get their turn."""
        self._cancelling = True
        for session in self.store.sessions():
            if session.cancel is not None:
                session.cancel.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no generation runs or waits, up to `timeout_s`; returns whether it is idle."""
        deadline = time.monotonic() + timeout_s
        while self.active_generations and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.active_generations == 0

    def shutdown(self) -> None:
        self.engine.close()

    # -- internals ---------------------------------------------------------------------------------------------
    def _open_session(
        self,
        session_id: str,
        label: str,
        eos: Iterable[int],
        strategy: KVStrategy,
        tokens: list[int],
        last_access: float,
        compressor: KVCompressor,
    ) -> Session:
        layer_store = compressor_layer_store(self.config.backend, compressor, held=self.verifier.reads_held_keys)
        seq = SequenceState(
            cache=self.verifier.new_cache(strategy, layer_store=layer_store, restoration=self.restoration),
            tokens=list(tokens),
            draft_session=self.proposer.open(strategy),
        )
        session = Session(
            session_id=session_id,
            label=label,
            eos_token_ids=frozenset(eos),
            seq=seq,
            last_access=last_access,
            compressor=compressor,
        )
        self.store.add(session)
        return session

    def _check_accepting(self) -> None:
        if not self._accepting:
            raise ShuttingDown("the server is shutting down")
