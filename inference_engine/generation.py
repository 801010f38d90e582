"""One generation as the engine loop runs it: its request, its running totals, and the queue its consumer reads."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from inference_engine.domain import GenerationStats, StopReason
from kv_cache_proposer.controls import DecodeControls, TokenLogprob
from kv_cache_proposer.decoding import GenerationBudget, SequenceState, StepRequest, StepResult, StopCause
from kv_cache_proposer.sampling import SamplingParams

STOP_REASONS = {
    StopCause.EOS: StopReason.EOS,
    StopCause.MAX_TOKENS: StopReason.MAX_TOKENS,
    StopCause.HISTORY_LIMIT: StopReason.TRUNCATED,
    StopCause.STOP_SEQUENCE: StopReason.STOP_SEQUENCE,
    StopCause.GRAMMAR_DEAD_END: StopReason.GRAMMAR_DEAD_END,
}


@dataclass(slots=True)
class Tally:
    """Running totals of one generation."""

    started: float
    prefill_tokens: int
    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0
    first_token_at: float | None = None
    stop_sequence_index: int | None = None

    def add(self, step: StepResult) -> None:
        self.generated += len(step.tokens)
        self.drafted += step.drafted
        self.accepted += step.accepted
        self.forwards += step.forwards
        if step.stop_sequence_index is not None:
            self.stop_sequence_index = step.stop_sequence_index

    def stats(self, reason: StopReason, now: float) -> GenerationStats:
        first = self.first_token_at
        return GenerationStats(
            stop_reason=reason,
            generated_token_count=self.generated,
            prefill_token_count=self.prefill_tokens,
            prefill_duration_s=(first if first is not None else now) - self.started,
            total_duration_s=now - self.started,
            time_to_first_token_s=(first - self.started) if first is not None else 0.0,
            draft_token_count=self.drafted,
            accepted_draft_token_count=self.accepted,
            verifier_forward_count=self.forwards,
            stop_sequence_index=self.stop_sequence_index,
        )


@dataclass(slots=True)
class StepOutput:
    """What one step gave its generation: tokens now in the history (journaled by `journaled`), and the end."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    truncated: int = 0  # history tokens the cache dropped, reported with the first token
    journaled: Future[None] | None = None  # the journal write of `tokens`; None without a journal or tokens
    done: GenerationStats | None = None  # the generation ended after this step
    error: Exception | None = None  # the step failed; the generation ended


class Generation:
    """A generation on a session that holds its generation turn.

    The engine loop (its own thread) steps it and pushes a `StepOutput` per step; the consumer (on the event loop)
    reads them with `next_output`. The engine steps a generation only while its consumer has finished every output
    but the newest, so the history runs at most one step ahead of the stream.
    """

    def __init__(
        self,
        session_id: str,
        seq: SequenceState,
        sampling: SamplingParams,
        budget: GenerationBudget,
        controls: DecodeControls,
        cancel: asyncio.Event,
    ) -> None:
        self.session_id = session_id
        self.seq = seq
        self.sampling = sampling
        self.budget = budget
        self.controls = controls
        self.cancel = cancel
        self.tally = Tally(started=time.perf_counter(), prefill_tokens=seq.pending_count)
        self.ready_at = self.tally.started  # when it last became ready for a step (engine thread)
        self.produced = 0  # outputs the engine made (engine thread)
        self.finished = 0  # outputs the consumer is done with (event loop)
        self.abandoned = False  # the consumer went away (event loop)
        self.on_finished: Callable[[], None] = lambda: None  # set by the engine loop: wakes it
        self.before_done: Callable[[], object] = lambda: None  # run on the engine thread before Done goes out
        self._loop = asyncio.get_running_loop()
        self._outputs: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._ended = asyncio.Event()
        self._taken = False  # whether an output was handed out and not yet marked finished

    # -- the engine loop's side (its thread) -------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Whether its consumer has finished every output but the newest (so it may take a step)."""
        return self.produced - self.finished <= 1

    @property
    def stopping(self) -> bool:
        """Whether it should take no further step: cancelled, or its consumer went away."""
        return self.abandoned or self.cancel.is_set()

    def request(self) -> StepRequest:
        return StepRequest(self.seq, self.sampling, self.budget, self.tally.generated, self.controls)

    def push(self, output: StepOutput) -> None:
        """Hand an output to the consumer (thread-safe)."""
        call_soon(self._loop, self._outputs.put_nowait, output)

    def end(self) -> None:
        """The engine loop takes no further step for it (thread-safe; after its last `push`)."""
        call_soon(self._loop, self._ended.set)

    # -- the consumer's side (the event loop) ------------------------------------------------------------------
    async def next_output(self) -> StepOutput:
        """The next step's output; the previous one is done with (so the engine may step again)."""
        self._finish_taken()
        output = await self._outputs.get()
        self._taken = True
        return output

    def abandon(self) -> None:
        """The consumer goes away: no step is taken after the one under way, if any."""
        self.abandoned = True
        self._finish_taken()

    async def ended(self) -> list[StepOutput]:
        """Wait until the engine loop is done with it; the outputs nobody read."""
        await self._ended.wait()
        left = []
        while not self._outputs.empty():
            left.append(self._outputs.get_nowait())
        return left

    @property
    def has_ended(self) -> bool:
        return self._ended.is_set()

    def _finish_taken(self) -> None:
        if self._taken:
            self._taken = False
            self.finished += 1
        self.on_finished()


def call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object) -> None:
    """`callback(*args)` on `loop`, from any thread; nothing when the loop has closed (nobody is left to tell)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)
