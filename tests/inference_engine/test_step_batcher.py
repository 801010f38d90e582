"""The step batcher: which steps share a forward (arrival order, batch size, prefill budget), and cancellation."""

from __future__ import annotations

import asyncio
import random

from inference_engine.batching import StepBatcher, _Queued
from inference_engine.metrics import Metrics
from inference_engine.worker import ModelWorker
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState, StepRequest, StepResult
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy
from tests.support.checkpoints import VOCAB_SIZE

CHUNK = 16


def _seq(verifier, pending: int, seed: int = 0) -> SequenceState:
    rng = random.Random(seed)
    return SequenceState(
        cache=verifier.new_cache(FullStrategy()), tokens=[rng.randrange(VOCAB_SIZE) for _ in range(pending)]
    )


def _request(seq: SequenceState) -> StepRequest:
    return StepRequest(seq, SamplingParams(), GenerationBudget(8), 0)


def _batcher(verifier, max_batch_size: int) -> tuple[StepBatcher, Metrics, ModelWorker]:
    metrics, worker = Metrics(), ModelWorker()
    decoder = Decoder(verifier, prefill_chunk_tokens=CHUNK)
    return StepBatcher(worker, decoder, metrics, max_batch_size=max_batch_size, token_budget=CHUNK), metrics, worker


def _sample(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    value = metrics.registry.get_sample_value(name, labels or {})
    assert value is not None, name
    return value


def test_a_forward_prefills_one_chunk_at_most_and_decode_steps_always_join(verifiers):
    verifier = verifiers["qwen3"]
    batcher, _, worker = _batcher(verifier, max_batch_size=4)

    async def run() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        pendings = [40, 1, 10, 1, 1, 5]  # a long prompt, decode steps, two short prompts
        batcher._queue = [_Queued(_request(_seq(verifier, n, i)), loop.create_future()) for i, n in enumerate(pendings)]
        order = {id(q): i for i, q in enumerate(batcher._queue)}
        first = [order[id(q)] for q in batcher._select()]
        second = [order[id(q)] for q in batcher._select()]
        return [first, second]

    try:
        first, second = asyncio.run(run())
    finally:
        worker.shutdown()
    # The long prompt fills the prefill budget; the decode steps behind it join, the 10-token prompt waits and goes
    # first next time, and the batch stops at 4 steps.
    assert first == [0, 1, 3, 4]
    assert second == [2, 5]


def test_concurrent_steps_share_one_forward_and_get_their_results_alone(verifiers):
    verifier = verifiers["qwen3"]
    expected = [
        Decoder(verifier, prefill_chunk_tokens=CHUNK).step(
            _seq(verifier, 5, i), SamplingParams(), GenerationBudget(8), 0
        )
        for i in range(3)
    ]
    batcher, metrics, worker = _batcher(verifier, max_batch_size=8)

    async def run() -> list[StepResult]:
        seqs = [_seq(verifier, 5, i) for i in range(3)]
        for _ in seqs:
            batcher.begin_generation()
        try:
            return await asyncio.gather(*(batcher.step(_request(s), asyncio.Event()) for s in seqs))
        finally:
            for _ in seqs:
                batcher.end_generation()

    try:
        results = asyncio.run(run())
    finally:
        worker.shutdown()
    assert [r.tokens for r in results] == [e.tokens for e in expected]
    assert _sample(metrics, "kakeya_batch_forwards_total") == 1
    assert _sample(metrics, "kakeya_batch_size_sum") == 3
    assert _sample(metrics, "kakeya_batch_queue_wait_seconds_count") == 3


def test_batch_size_one_runs_every_step_alone(verifiers):
    verifier = verifiers["qwen3"]
    batcher, metrics, worker = _batcher(verifier, max_batch_size=1)

    async def run() -> None:
        seqs = [_seq(verifier, 3, i) for i in range(3)]
        await asyncio.gather(*(batcher.step(_request(s), asyncio.Event()) for s in seqs))

    try:
        asyncio.run(run())
    finally:
        worker.shutdown()
    assert _sample(metrics, "kakeya_batch_forwards_total") == 3
    assert _sample(metrics, "kakeya_batch_size_bucket", {"le": "1.0"}) == 3


def test_a_step_cancelled_while_queued_is_dropped_and_the_others_run(verifiers):
    verifier = verifiers["qwen3"]
    batcher, metrics, worker = _batcher(verifier, max_batch_size=8)

    async def run() -> tuple[bool, bool, list[int], int]:
        seqs = [_seq(verifier, 4, i) for i in range(3)]
        for _ in seqs:
            batcher.begin_generation()  # the dispatcher gathers, waiting for all three
        flags = [asyncio.Event() for _ in seqs]
        tasks = [asyncio.create_task(batcher.step(_request(s), f)) for s, f in zip(seqs[:2], flags, strict=False)]
        await asyncio.sleep(0)  # both queued; the third generation has not queued yet
        tasks[0].cancel()
        await asyncio.sleep(0)  # the cancellation reaches the step while the dispatcher still gathers
        batcher.end_generation()
        batcher.end_generation()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        batcher.end_generation()
        kept = results[1]
        assert isinstance(kept, StepResult)
        return isinstance(results[0], asyncio.CancelledError), flags[0].is_set(), kept.tokens, seqs[0].committed

    try:
        cancelled, flagged, tokens, untouched = asyncio.run(run())
    finally:
        worker.shutdown()
    assert cancelled and flagged
    assert len(tokens) == 1 and untouched == 0, "the cancelled step never ran"
    assert _sample(metrics, "kakeya_batch_size_sum") == 1
