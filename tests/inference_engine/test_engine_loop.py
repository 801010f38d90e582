"""The engine loop: which generations share a forward (arrival order, batch size, prefill budget), a lagging
consumer, cancellation, calls between steps and shutdown."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable

import pytest

from inference_engine.engine import EngineLoop, plan_batch
from inference_engine.errors import ShuttingDown
from inference_engine.generation import Generation, StepOutput
from inference_engine.metrics import Metrics
from kv_cache_proposer.controls import DecodeControls
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy
from tests.support.checkpoints import VOCAB_SIZE

CHUNK = 16


def _seq(verifier, pending: int, seed: int = 0) -> SequenceState:
    rng = random.Random(seed)
    return SequenceState(
        cache=verifier.new_cache(FullStrategy()), tokens=[rng.randrange(VOCAB_SIZE) for _ in range(pending)]
    )


def _generation(seq: SequenceState, max_new_tokens: int, name: str = "s") -> Generation:
    return Generation(name, seq, SamplingParams(), GenerationBudget(max_new_tokens), DecodeControls(), asyncio.Event())


def _decoder(verifier) -> Decoder:
    return Decoder(verifier, prefill_chunk_tokens=CHUNK, burst_tokens=1)


def _engine(verifier, max_batch_size: int) -> tuple[EngineLoop, Metrics]:
    metrics = Metrics()
    return EngineLoop(_decoder(verifier), metrics, max_batch_size=max_batch_size, token_budget=CHUNK), metrics


def _sample(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    value = metrics.registry.get_sample_value(name, labels or {})
    assert value is not None, name
    return value


async def _drain(generation: Generation) -> tuple[list[int], StepOutput]:
    tokens: list[int] = []
    while True:
        output = await generation.next_output()
        if output.error is not None:
            raise output.error
        tokens += output.tokens
        if output.done is not None:
            return tokens, output


async def _begin_together(
    engine: EngineLoop, generations: list[Generation], meanwhile: Callable[[], object] = lambda: None
) -> None:
    """Begin `generations` while a call holds the engine thread (and run `meanwhile` there too), so that they
    arrive together at its next turn."""
    gate, entered = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        gate.wait(30)

    held = asyncio.ensure_future(engine.call(hold))
    while not entered.is_set():
        await asyncio.sleep(0.001)
    for generation in generations:
        engine.begin(generation)
    meanwhile()
    gate.set()
    await held


def test_a_forward_prefills_one_chunk_at_most_and_decode_steps_always_join():
    # A long prompt, decode steps, two short prompts (prompt tokens: pending tokens but the last).
    candidates = [n - 1 for n in (40, 1, 10, 1, 1, 5)]
    first = plan_batch(candidates, max_batch_size=4, token_budget=CHUNK)
    left = [i for i in range(len(candidates)) if i not in first]
    second = [left[i] for i in plan_batch([candidates[i] for i in left], max_batch_size=4, token_budget=CHUNK)]
    # The long prompt fills the prefill budget; the decode steps behind it join, the 10-token prompt waits and goes
    # first next time, and the batch stops at 4 steps.
    assert first == [0, 1, 3, 4]
    assert second == [2, 5]


def test_generations_that_arrive_together_share_one_forward_and_get_their_results_alone(verifiers):
    verifier = verifiers["qwen3"]
    expected = [
        _decoder(verifier).step(_seq(verifier, 5, i), SamplingParams(), GenerationBudget(1), 0) for i in range(3)
    ]
    engine, metrics = _engine(verifier, max_batch_size=8)

    async def run() -> list[tuple[list[int], StepOutput]]:
        generations = [_generation(_seq(verifier, 5, i), 1, f"s{i}") for i in range(3)]
        await _begin_together(engine, generations)
        return await asyncio.gather(*(_drain(g) for g in generations))

    try:
        results = asyncio.run(run())
    finally:
        engine.close()
    assert [tokens for tokens, _ in results] == [e.tokens for e in expected]
    assert all(done.done is not None and done.done.stop_reason.value == "max_tokens" for _, done in results)
    assert _sample(metrics, "kakeya_batch_forwards_total") == 1
    assert _sample(metrics, "kakeya_batch_size_sum") == 3


def test_batch_size_one_runs_every_step_alone(verifiers):
    verifier = verifiers["qwen3"]
    engine, metrics = _engine(verifier, max_batch_size=1)

    async def run() -> None:
        generations = [_generation(_seq(verifier, 3, i), 1, f"s{i}") for i in range(3)]
        await _begin_together(engine, generations)
        await asyncio.gather(*(_drain(g) for g in generations))

    try:
        asyncio.run(run())
    finally:
        engine.close()
    assert _sample(metrics, "kakeya_batch_forwards_total") == 3
    assert _sample(metrics, "kakeya_batch_size_bucket", {"le": "1.0"}) == 3


def test_free_memory_goes_back_to_the_system_after_each_forward_that_prefilled_and_only_then(verifiers, monkeypatch):
    verifier = verifiers["qwen3"]
    engine, _ = _engine(verifier, max_batch_size=1)
    events: list[str] = []
    step_batch = engine.decoder.step_batch

    def recorded_step(requests):
        events.append("prefill" if any(r.seq.pending_count > 1 for r in requests) else "decode")
        return step_batch(requests)

    monkeypatch.setattr(engine.decoder, "step_batch", recorded_step)
    monkeypatch.setattr("inference_engine.engine.release_free_memory", lambda: events.append("trim"))

    async def run() -> None:
        generation = _generation(_seq(verifier, 3 * CHUNK + 5), 4)
        engine.begin(generation)
        await _drain(generation)

    try:
        asyncio.run(run())
    finally:
        engine.close()
    assert events.count("prefill") == 4 and events.count("decode") == 3  # 53 pending tokens in 16-token chunks
    # each prefill forward is followed by a trim, a decode step never is
    assert all(events[i + 1] == "trim" for i, event in enumerate(events) if event == "prefill")
    assert all(i + 1 == len(events) or events[i + 1] != "trim" for i, event in enumerate(events) if event == "decode")


def test_a_generation_cancelled_before_its_step_ends_untouched_and_the_others_run(verifiers):
    verifier = verifiers["qwen3"]
    engine, metrics = _engine(verifier, max_batch_size=8)

    async def run() -> tuple[list[int], StepOutput, list[int], int]:
        seqs = [_seq(verifier, 4, i) for i in range(2)]
        generations = [_generation(seq, 1, f"s{i}") for i, seq in enumerate(seqs)]
        await _begin_together(engine, generations, meanwhile=generations[0].cancel.set)
        (cancelled_tokens, cancelled), (kept, _) = await asyncio.gather(*(_drain(g) for g in generations))
        return cancelled_tokens, cancelled, kept, seqs[0].committed

    try:
        cancelled_tokens, cancelled, kept, untouched = asyncio.run(run())
    finally:
        engine.close()
    assert cancelled.done is not None and cancelled.done.stop_reason.value == "cancelled"
    assert cancelled_tokens == [] and untouched == 0, "the cancelled generation never stepped"
    assert len(kept) == 1
    assert _sample(metrics, "kakeya_batch_size_sum") == 1


def test_a_consumer_that_stops_reading_holds_back_its_generation_only(verifiers):
    verifier = verifiers["qwen3"]
    engine, _ = _engine(verifier, max_batch_size=8)

    async def run() -> tuple[int, int, list[int]]:
        stalled_seq = _seq(verifier, 4, 1)
        stalled = _generation(stalled_seq, 50, "stalled")
        engine.begin(stalled)
        await stalled.next_output()  # takes the first output, then reads no more
        reader = _generation(_seq(verifier, 4, 2), 12, "reader")
        engine.begin(reader)
        tokens, _ = await _drain(reader)
        history = len(stalled_seq.tokens) - 4
        stalled.abandon()
        left = await stalled.ended()
        return history, len(left), tokens

    try:
        stalled_history, unread, tokens = asyncio.run(run())
    finally:
        engine.close()
    assert len(tokens) == 12, "the other generation ran to its end"
    # The stalled consumer holds its first output: its generation took one more step and waits.
    assert stalled_history == 2
    assert unread == 1


@pytest.mark.parametrize("gather_s", [0.0, 0.1])
def test_the_others_wait_for_a_slow_reader_up_to_the_gather_time_and_not_at_all_with_none(verifiers, gather_s):
    verifier = verifiers["qwen3"]
    metrics = Metrics()
    engine = EngineLoop(_decoder(verifier), metrics, max_batch_size=8, token_budget=CHUNK, gather_s=gather_s)
    waits: list[float] = []
    observe = metrics.batch_queue_wait_seconds.observe

    def record(seconds: float) -> None:
        waits.append(seconds)
        observe(seconds)

    metrics.batch_queue_wait_seconds.observe = record  # type: ignore[method-assign]

    async def run() -> list[int]:
        stalled = _generation(_seq(verifier, 4, 1), 50, "stalled")
        engine.begin(stalled)
        await stalled.next_output()  # takes the first output, then reads no more
        reader = _generation(_seq(verifier, 4, 2), 4, "reader")
        engine.begin(reader)
        tokens, _ = await _drain(reader)
        stalled.abandon()
        await stalled.ended()
        return tokens

    try:
        tokens = asyncio.run(run())
    finally:
        engine.close()
    assert len(tokens) == 4
    # The reader's steps after its first waited for the stalled generation's reader the whole gather time (it never
    # caught up), or, with none, did not wait for it.
    reader_waits = waits[-3:]
    if gather_s:
        assert all(wait >= gather_s for wait in reader_waits), reader_waits
    else:
        assert all(wait < 0.1 for wait in reader_waits), reader_waits


def test_calls_run_on_the_engine_thread_and_raise_what_they_raise(verifiers):
    engine, _ = _engine(verifiers["qwen3"], max_batch_size=4)

    def fails() -> None:
        raise ValueError("no")

    async def run() -> tuple[str, str]:
        name = await engine.call(lambda: threading.current_thread().name)
        with pytest.raises(ValueError, match="no"):
            await engine.call(fails)
        return name, threading.current_thread().name

    try:
        engine_thread, caller_thread = asyncio.run(run())
    finally:
        engine.close()
    assert engine_thread == "kakeya-engine" != caller_thread


def test_closing_ends_running_generations_and_refuses_calls(verifiers):
    verifier = verifiers["qwen3"]
    engine, _ = _engine(verifier, max_batch_size=4)

    async def run() -> None:
        generation = _generation(_seq(verifier, 4), 1000)
        engine.begin(generation)
        await generation.next_output()  # the consumer holds it: no step runs past the next
        await asyncio.to_thread(engine.close)
        with pytest.raises(ShuttingDown):
            while True:
                output = await generation.next_output()
                if output.error is not None:
                    raise output.error
        with pytest.raises(ShuttingDown):
            await engine.call(lambda: None)

    asyncio.run(run())
