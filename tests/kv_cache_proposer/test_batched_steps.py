"""`Decoder.step_batch`: the steps of several sessions in one forward, each giving what it gives alone, and a
failing session failing alone."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from kv_cache_proposer.cache import LayerStoreFactory
from kv_cache_proposer.compression import KVCompressor, compressor_layer_store
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState, StepRequest, StepResult
from kv_cache_proposer.errors import InvariantViolation
from kv_cache_proposer.proposers.base import DraftPolicy, NoDraftSession
from kv_cache_proposer.proposers.ngram import NgramProposer
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import DlmRestoreStrategy, FullStrategy, KVStrategy, SinkWindowStrategy
from tests.support.backends import BACKENDS
from tests.support.checkpoints import VOCAB_SIZE

pytestmark = pytest.mark.parametrize("backend", BACKENDS)

MAX_TOKENS = 20


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    base = [rng.randrange(VOCAB_SIZE) for _ in range(max(1, n // 3))]
    return (base * 3 + base)[:n]  # repeats, so the ngram proposer finds drafts


# (strategy, prompt length, sampling): greedy and seeded sampling, full, sink_window and dlm_restore, a prompt
# longer than a prefill chunk beside short ones.
SPECS: list[tuple[KVStrategy, int, SamplingParams]] = [
    (FullStrategy(), 5, SamplingParams()),
    (SinkWindowStrategy(sink=2, window=10), 17, SamplingParams()),
    (FullStrategy(), 40, SamplingParams(temperature=0.9, seed=7)),
    (SinkWindowStrategy(sink=1, window=8), 9, SamplingParams(temperature=1.1, top_k=20, seed=3)),
    (FullStrategy(), 1, SamplingParams(temperature=0.7, top_p=0.9, seed=11)),
    (DlmRestoreStrategy(sink=2, window=9), 26, SamplingParams()),
]


def _sequences(verifier, proposer: str, packed: LayerStoreFactory | None = None) -> list[SequenceState]:
    """One sequence per spec; with `packed`, the sessions that do not restore hold their K/V packed."""
    out = []
    for index, (strategy, length, _) in enumerate(SPECS):
        draft = NgramProposer(max_n=3).open(strategy) if proposer == "ngram" else NoDraftSession()
        store = packed if packed is not None and not isinstance(strategy, DlmRestoreStrategy) else None
        cache = verifier.new_cache(strategy, layer_store=store)
        out.append(SequenceState(cache=cache, tokens=_prompt(index, length), draft_session=draft))
    return out


def _alone(decoder: Decoder, seq: SequenceState, params: SamplingParams) -> list[int]:
    budget = GenerationBudget(MAX_TOKENS)
    generated: list[int] = []
    while True:
        step = decoder.step(seq, params, budget, len(generated))
        generated += step.tokens
        if step.stop is not None:
            return generated


def _together(
    decoder: Decoder, seqs: list[SequenceState], before: Callable[[int], None] = lambda _: None
) -> tuple[list[list[int] | Exception], list[int]]:
    """Step every sequence in batches until each stops or fails; returns its tokens or its error, and the batch
    sizes."""
    budget = GenerationBudget(MAX_TOKENS)
    outcome: list[list[int] | Exception] = [[] for _ in seqs]
    running = list(range(len(seqs)))
    sizes = []
    round_ = 0
    while running:
        before(round_)
        requests = [StepRequest(seqs[i], SPECS[i][2], budget, len(outcome[i])) for i in running]  # type: ignore[arg-type]
        sizes.append(len(requests))
        results = decoder.step_batch(requests)
        still = []
        for i, result in zip(running, results, strict=True):
            if isinstance(result, Exception):
                outcome[i] = result
                continue
            assert isinstance(result, StepResult)
            tokens = outcome[i]
            assert isinstance(tokens, list)
            tokens += result.tokens
            if result.stop is None:
                still.append(i)
        running = still
        round_ += 1
    return outcome, sizes


@pytest.mark.parametrize("proposer", ["none", "ngram"])
def test_batched_steps_give_every_session_its_tokens_alone(verifiers, proposer):
    verifier = verifiers["qwen3"]
    decoder = Decoder(verifier, prefill_chunk_tokens=16)
    expected = [_alone(decoder, seq, SPECS[i][2]) for i, seq in enumerate(_sequences(verifier, proposer))]
    together, sizes = _together(decoder, _sequences(verifier, proposer))
    assert together == expected
    assert max(sizes) == len(SPECS)


def test_batched_steps_that_look_at_a_lookup_before_deciding_give_every_session_its_tokens_alone(verifiers):
    """Under `cost`, a lookup measured to cost next to nothing is proposed before the decision, also when the
    step runs in a batch: the batch drafts it once, and each session gets its tokens alone."""
    verifier = verifiers["qwen3"]

    def measured() -> list[SequenceState]:
        seqs = _sequences(verifier, "ngram")
        for seq in seqs:  # lookups cost nothing and are accepted whole: every step looks first
            limit = seq.draft_session.max_draft_tokens
            for _ in range(4):
                seq.draft_costs.observe_draft(limit, limit, 1e-7)
                seq.draft_costs.observe_forward(limit + 1, 0.001)
            seq.draft_costs.observe_forward(1, 0.001)
            assert seq.draft_costs.peeks(limit)
        return seqs

    decoder = Decoder(verifier, prefill_chunk_tokens=16, draft_policy=DraftPolicy.COST)
    expected = [_alone(decoder, seq, SPECS[i][2]) for i, seq in enumerate(measured())]
    together, sizes = _together(decoder, measured())
    assert together == expected
    assert max(sizes) == len(SPECS)


def test_batched_steps_over_packed_sessions_give_every_session_its_tokens_alone(verifiers, backend):
    verifier = verifiers["qwen3"]
    packed = compressor_layer_store(backend, KVCompressor("kakeya_d4", 38))
    decoder = Decoder(verifier, prefill_chunk_tokens=16)
    expected = [_alone(decoder, seq, SPECS[i][2]) for i, seq in enumerate(_sequences(verifier, "none", packed))]
    together, sizes = _together(decoder, _sequences(verifier, "none", packed))
    assert together == expected
    assert max(sizes) == len(SPECS)


def test_a_session_that_breaks_an_invariant_fails_alone(verifiers):
    verifier = verifiers["gemma3"]
    decoder = Decoder(verifier, prefill_chunk_tokens=16)
    expected = [_alone(decoder, seq, SPECS[i][2]) for i, seq in enumerate(_sequences(verifier, "none"))]
    seqs = _sequences(verifier, "none")

    def corrupt(round_: int) -> None:
        if round_ == 3:
            seqs[1].cache._layers[0].held += 1  # type: ignore[attr-defined]  # its next commit finds the mismatch

    together, _ = _together(decoder, seqs, corrupt)
    assert isinstance(together[1], InvariantViolation) and together[1].kind == "inv1"
    assert [t for i, t in enumerate(together) if i != 1] == [t for i, t in enumerate(expected) if i != 1]


def test_a_row_that_breaks_the_batched_forward_fails_alone(verifiers):
    verifier = verifiers["llama"]
    decoder = Decoder(verifier, prefill_chunk_tokens=16)
    expected = [_alone(decoder, seq, SPECS[i][2]) for i, seq in enumerate(_sequences(verifier, "none"))]
    seqs = _sequences(verifier, "none")
    broken = seqs[2].cache

    def stage_layer(layer_idx, keys, values):
        raise InvariantViolation("inv1", "layer storage broke")

    def corrupt(round_: int) -> None:
        if round_ == 2:  # the forward raises inside the model, batched or alone
            broken.stage_layer = stage_layer  # type: ignore[method-assign]
            broken.stage_layer_parts = stage_layer  # type: ignore[method-assign]

    together, _ = _together(decoder, seqs, corrupt)
    assert isinstance(together[2], InvariantViolation) and "layer storage broke" in str(together[2])
    assert [t for i, t in enumerate(together) if i != 2] == [t for i, t in enumerate(expected) if i != 2]


def test_a_step_that_cannot_start_fails_alone(verifiers):
    verifier = verifiers["qwen3"]
    decoder = Decoder(verifier)
    ready = SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=[1, 2, 3])
    empty = SequenceState(cache=verifier.new_cache(FullStrategy()), tokens=[])
    budget = GenerationBudget(4)
    results = decoder.step_batch(
        [StepRequest(empty, SamplingParams(), budget, 0), StepRequest(ready, SamplingParams(), budget, 0)]
    )
    assert isinstance(results[0], ValueError) and "no pending token" in str(results[0])
    assert isinstance(results[1], StepResult) and len(results[1].tokens) == 1
