"""The step scheduler: which steps share a forward (arrival order, batch size, prefill budget), and cancellation."""

from __future__ import annotations

import asyncio
import random
import threading

from inference_engine.metrics import Metrics
from inference_engine.step_scheduler import StepScheduler, StepTicket
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


def _scheduler(verifier, max_batch_size: int) -> tuple[StepScheduler, Metrics, ModelWorker]:
    metrics, worker = Metrics(), ModelWorker()
    decoder = Decoder(verifier, prefill_chunk_tokens=CHUNK, burst_tokens=1)
    return StepScheduler(worker, decoder, metrics, max_batch_size=max_batch_size, token_budget=CHUNK), metrics, worker


def _sample(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    value = metrics.registry.get_sample_value(name, labels or {})
    assert value is not None, name
    return value


def test_a_forward_prefills_one_chunk_at_most_and_decode_steps_always_join(verifiers):
    verifier = verifiers["qwen3"]
    scheduler, _, worker = _scheduler(verifier, max_batch_size=4)

    async def run() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        pendings = [40, 1, 10, 1, 1, 5]  # a long prompt, decode steps, two short prompts
        scheduler._queue = [
            StepTicket(_request(_seq(verifier, n, i)), loop.create_future()) for i, n in enumerate(pendings)
        ]
        order = {id(q): i for i, q in enumerate(scheduler._queue)}
        first = [order[id(q)] for q in scheduler._select()]
        second = [order[id(q)] for q in scheduler._select()]
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
        Decoder(verifier, prefill_chunk_tokens=CHUNK, burst_tokens=1).step(
            _seq(verifier, 5, i), SamplingParams(), GenerationBudget(8), 0
        )
        for i in range(3)
    ]
    scheduler, metrics, worker = _scheduler(verifier, max_batch_size=8)

    async def run() -> list[StepResult]:
        seqs = [_seq(verifier, 5, i) for i in range(3)]
        for _ in seqs:
            scheduler.begin_generation()
        try:
            return await asyncio.gather(*(scheduler.step(_request(s), asyncio.Event()) for s in seqs))
        finally:
            for _ in seqs:
                scheduler.end_generation()

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
    scheduler, metrics, worker = _scheduler(verifier, max_batch_size=1)

    async def run() -> None:
        seqs = [_seq(verifier, 3, i) for i in range(3)]
        await asyncio.gather(*(scheduler.step(_request(s), asyncio.Event()) for s in seqs))

    try:
        asyncio.run(run())
    finally:
        worker.shutdown()
    assert _sample(metrics, "kakeya_batch_forwards_total") == 3
    assert _sample(metrics, "kakeya_batch_size_bucket", {"le": "1.0"}) == 3


def test_a_step_cancelled_while_queued_is_dropped_and_the_others_run(verifiers):
    verifier = verifiers["qwen3"]
    scheduler, metrics, worker = _scheduler(verifier, max_batch_size=8)

    async def run() -> tuple[bool, bool, list[int], int]:
        seqs = [_seq(verifier, 4, i) for i in range(3)]
        for _ in seqs:
            scheduler.begin_generation()  # the dispatcher gathers, waiting for all three
        flags = [asyncio.Event() for _ in seqs]
        tasks = [asyncio.create_task(scheduler.step(_request(s), f)) for s, f in zip(seqs[:2], flags, strict=False)]
        await asyncio.sleep(0)  # both queued; the third generation has not queued yet
        tasks[0].cancel()
        await asyncio.sleep(0)  # the cancellation reaches the step while the dispatcher still gathers
        scheduler.end_generation()
        scheduler.end_generation()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        scheduler.end_generation()
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


def _decode_request(verifier, seed: int, *, max_new_tokens: int = 8) -> StepRequest:
    """A decode step of a generation past its first token (a prefilled sequence with one pending token)."""
    seq = _seq(verifier, 5, seed)
    Decoder(verifier, prefill_chunk_tokens=CHUNK, burst_tokens=1).step(seq, SamplingParams(), GenerationBudget(8), 0)
    return StepRequest(seq, SamplingParams(), GenerationBudget(max_new_tokens), 1)


def _expected_tokens(verifier, seed: int, steps: int) -> list[int]:
    request = _decode_request(verifier, seed)
    decoder = Decoder(verifier, prefill_chunk_tokens=CHUNK, burst_tokens=1)
    tokens: list[int] = []
    for i in range(steps):
        tokens += decoder.step(request.seq, request.params, request.budget, 1 + i).tokens
    return tokens


def test_a_lone_generation_awaiting_its_step_gets_the_next_step_chained_by_the_worker(verifiers):
    verifier = verifiers["qwen3"]
    expected = _expected_tokens(verifier, 3, 2)
    scheduler, metrics, worker = _scheduler(verifier, max_batch_size=4)

    async def run() -> tuple[list[int], int]:
        cancel = asyncio.Event()
        scheduler.begin_generation()
        try:
            ticket = scheduler.submit(_decode_request(verifier, 3), cancel)
            first = await scheduler.result(ticket, cancel)
            assert ticket.chained is not None, "the worker started the next step as this one returned"
            second = await scheduler.result(ticket.chained, cancel)
            return first.tokens + second.tokens, ticket.chained.request.generated
        finally:
            scheduler.end_generation()

    try:
        tokens, generated = asyncio.run(run())
    finally:
        worker.shutdown()
    assert tokens == expected, "a chained step continues the sequence as a queued one would"
    assert generated == 2
    assert scheduler.started_steps >= 2
    assert _sample(metrics, "kakeya_batch_forwards_total") >= 2


def test_the_worker_chains_no_step_after_a_stop_a_cancellation_or_while_others_need_it(verifiers):
    verifier = verifiers["qwen3"]
    scheduler, _, worker = _scheduler(verifier, max_batch_size=4)

    async def chained_after(
        request: StepRequest, *, cancelled: bool = False, other_generation: bool = False, worker_call: bool = False
    ) -> bool:
        cancel = asyncio.Event()
        if cancelled:
            cancel.set()
        generations = 2 if other_generation else 1
        for _ in range(generations):
            scheduler.begin_generation()
        gate = threading.Event()
        try:
            # With `worker_call`, another call is waiting for the worker while the step runs: the worker is held
            # until the step is queued behind the holding call, then the other call queues behind the step.
            holding = asyncio.ensure_future(worker.run(gate.wait, 30)) if worker_call else None
            ticket = scheduler.submit(request, cancel)
            waiting = None
            if worker_call:
                async with asyncio.timeout(30):
                    while worker.backlog < 1:
                        await asyncio.sleep(0.001)
                waiting = asyncio.ensure_future(worker.run(lambda: "ran"))
                await asyncio.sleep(0)
            gate.set()
            await scheduler.result(ticket, cancel)
            if holding is not None and waiting is not None:
                assert await holding and await waiting == "ran"
            if ticket.chained is not None:  # settle it before the next case
                await scheduler.result(ticket.chained, asyncio.Event())
            return ticket.chained is not None
        finally:
            gate.set()
            for _ in range(generations):
                scheduler.end_generation()

    async def run() -> dict[str, bool]:
        return {
            "stop": await chained_after(_decode_request(verifier, 4, max_new_tokens=2)),
            "cancelled": await chained_after(_decode_request(verifier, 5), cancelled=True),
            "other generation": await chained_after(_decode_request(verifier, 6), other_generation=True),
            "worker call waiting": await chained_after(_decode_request(verifier, 7), worker_call=True),
            "alone": await chained_after(_decode_request(verifier, 8)),
        }

    try:
        chained = asyncio.run(run())
    finally:
        worker.shutdown()
    assert chained == {
        "stop": False,
        "cancelled": False,
        "other generation": False,
        "worker call waiting": False,
        "alone": True,
    }
