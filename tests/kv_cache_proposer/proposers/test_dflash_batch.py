"""DFlash sessions stepping together: one drafter forward and one context projection per batch step, and every
session drafting, accepting and emitting exactly what it does alone."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState, StepRequest, StepResult
from kv_cache_proposer.errors import InvariantViolation
from kv_cache_proposer.proposers.base import NoDraftSession
from kv_cache_proposer.proposers.batch import batch_drafter_of
from kv_cache_proposer.proposers.dflash.mlx_proposer import MlxDFlashProposer
from kv_cache_proposer.proposers.dflash.proposer import DFlashProposer
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy, KVStrategy, SinkWindowStrategy
from tests.support.backends import BACKENDS
from tests.support.checkpoints import VOCAB_SIZE, save_dflash_drafter

pytestmark = pytest.mark.parametrize("backend", BACKENDS)
Proposer = DFlashProposer | MlxDFlashProposer

MAX_TOKENS = 24
STRATEGIES = {"full": FullStrategy(), "sink_window": SinkWindowStrategy(sink=2, window=12)}
# (prompt length, sampling): greedy and seeded sampling, and a prompt longer than a prefill chunk.
SESSIONS: list[tuple[int, SamplingParams]] = [
    (5, SamplingParams()),
    (23, SamplingParams()),
    (9, SamplingParams(temperature=0.9, seed=7)),
    (2, SamplingParams(temperature=1.1, top_k=20, seed=3)),
]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # Two layers, one of them over a sliding window, so every mask kind of the drafter meets the batch.
    return save_dflash_drafter(tmp_path_factory.mktemp("dflash") / "drafter", block_size=5, layers=2, sliding_window=6)


class Recorder:
    """Every draft the decoder attached to each sequence's block, in step order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.drafts: dict[int, list[list[int]]] = {}
        attach = Decoder._attach_draft

        def recording(plan: Any, proposed: list[int]) -> None:
            attach(plan, proposed)
            self.drafts.setdefault(id(plan.seq), []).append(list(plan.draft))

        monkeypatch.setattr(Decoder, "_attach_draft", staticmethod(recording))

    def of(self, seq: SequenceState) -> list[list[int]]:
        return self.drafts.get(id(seq), [])


def _load(backend: str, drafter_dir: Any, verifier: Any) -> Proposer:
    loader = DFlashProposer if backend == "torch" else MlxDFlashProposer
    return loader.load(drafter_dir, verifier)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE - 1) for _ in range(n)]


def _sequences(verifier: Any, proposer: Proposer, strategy: KVStrategy) -> list[SequenceState]:
    return [
        SequenceState(
            cache=verifier.new_cache(strategy), tokens=_prompt(i, length), draft_session=proposer.open(strategy)
        )
        for i, (length, _) in enumerate(SESSIONS)
    ]


def _alone(decoder: Decoder, seq: SequenceState, params: SamplingParams) -> list[tuple[int, ...]]:
    """Every step of one sequence alone: (tokens..., drafted, accepted) per step."""
    budget = GenerationBudget(MAX_TOKENS)
    steps: list[tuple[int, ...]] = []
    generated = 0
    while True:
        step = decoder.step(seq, params, budget, generated)
        generated += len(step.tokens)
        steps.append((*step.tokens, step.drafted, step.accepted))
        if step.stop is not None:
            return steps


def _together(
    decoder: Decoder,
    seqs: list[SequenceState],
    proposer: Proposer,
    before: Callable[[int], None] = lambda _: None,
) -> tuple[list[list[tuple[int, ...]] | Exception], list[tuple[int, int, int]]]:
    """Step every sequence through `step_batch` until each stops or fails. Returns per sequence its steps (as
    `_alone`) or its error, and per batch step (sessions that drafted, drafter forwards, context projections)."""
    budget = GenerationBudget(MAX_TOKENS)
    outcome: list[list[tuple[int, ...]] | Exception] = [[] for _ in seqs]
    generated = [0] * len(seqs)
    running = list(range(len(seqs)))
    rounds: list[tuple[int, int, int]] = []
    while running:
        before(len(rounds))
        forwards, projections = proposer.drafter_forwards, proposer.context_projections
        requests = [StepRequest(seqs[i], SESSIONS[i][1], budget, generated[i]) for i in running]
        results = decoder.step_batch(requests)
        drafted = sum(1 for r in results if isinstance(r, StepResult) and r.drafted)
        rounds.append((drafted, proposer.drafter_forwards - forwards, proposer.context_projections - projections))
        still = []
        for i, result in zip(running, results, strict=True):
            steps = outcome[i]
            if isinstance(result, Exception):
                outcome[i] = result
                continue
            assert isinstance(result, StepResult) and isinstance(steps, list)
            generated[i] += len(result.tokens)
            steps.append((*result.tokens, result.drafted, result.accepted))
            if result.stop is None:
                still.append(i)
        running = still
    return outcome, rounds


@pytest.mark.parametrize("strategy", list(STRATEGIES.values()), ids=list(STRATEGIES))
def test_sessions_drafting_together_draft_accept_and_emit_what_each_does_alone(
    verifiers: Any, backend: str, drafter_dir: Any, strategy: KVStrategy, monkeypatch: pytest.MonkeyPatch
) -> None:
    verifier = verifiers["qwen3"]
    proposer = _load(backend, drafter_dir, verifier)
    decoder = Decoder(verifier, prefill_chunk_tokens=16)
    recorder = Recorder(monkeypatch)
    alone_seqs = _sequences(verifier, proposer, strategy)
    expected = [_alone(decoder, seq, SESSIONS[i][1]) for i, seq in enumerate(alone_seqs)]
    alone_forwards = proposer.drafter_forwards
    seqs = _sequences(verifier, proposer, strategy)
    together, rounds = _together(decoder, seqs, proposer)
    assert together == expected
    assert [recorder.of(seq) for seq in seqs] == [recorder.of(seq) for seq in alone_seqs]
    assert sum(len(d) for seq in seqs for d in recorder.of(seq)) > 0
    # One drafter forward per batch step however many sessions drafted in it, and one context projection.
    assert all(forwards == min(drafted, 1) for drafted, forwards, _ in rounds)
    assert all(projections <= 1 for _, _, projections in rounds)
    assert max(drafted for drafted, _, _ in rounds) == len(SESSIONS)
    assert sum(forwards for _, forwards, _ in rounds) < alone_forwards


def test_every_session_of_a_proposer_shares_its_batch_drafter(verifiers: Any, backend: str, drafter_dir: Any) -> None:
    verifier = verifiers["qwen3"]
    proposer = _load(backend, drafter_dir, verifier)
    first, second = proposer.open(FullStrategy()), proposer.open(SinkWindowStrategy(sink=1, window=8))
    other = _load(backend, drafter_dir, verifier).open(FullStrategy())
    assert batch_drafter_of(first) is not None
    assert batch_drafter_of(first) is batch_drafter_of(second) is batch_drafter_of(first.clone(0))
    assert batch_drafter_of(other) is not batch_drafter_of(first)
    assert batch_drafter_of(NoDraftSession()) is None


def _corrupt_drafter_cache(seq: SequenceState, method: str) -> None:
    """Break one session's drafter context: staging (its next draft forward raises) or keeping new context (its
    next commit raises; dropping a draft block's K/V still works)."""
    cache = seq.draft_session._cache  # type: ignore[attr-defined]
    original = getattr(cache, method)

    def broken(*args: Any) -> Any:
        if method == "commit" and args == (0,):
            return original(*args)
        raise InvariantViolation("inv1", "drafter storage broke")

    setattr(cache, method, broken)


@pytest.mark.parametrize("method", ["stage_layer", "commit"], ids=["draft_forward", "context_commit"])
def test_a_session_whose_drafter_context_breaks_fails_alone(
    verifiers: Any, backend: str, drafter_dir: Any, method: str
) -> None:
    verifier = verifiers["qwen3"]
    proposer = _load(backend, drafter_dir, verifier)
    decoder = Decoder(verifier, prefill_chunk_tokens=16)
    strategy = STRATEGIES["sink_window"]
    expected = [_alone(decoder, seq, SESSIONS[i][1]) for i, seq in enumerate(_sequences(verifier, proposer, strategy))]
    seqs = _sequences(verifier, proposer, strategy)

    def corrupt(round_: int) -> None:
        if round_ == 3:
            _corrupt_drafter_cache(seqs[0], method)

    together, rounds = _together(decoder, seqs, proposer, corrupt)
    assert isinstance(together[0], InvariantViolation) and "drafter storage broke" in str(together[0])
    assert together[1:] == expected[1:]
    assert rounds[3][0] == len(SESSIONS) - 1  # the others drafted in the step where the broken one failed


def test_a_session_that_breaks_a_verifier_invariant_leaves_the_drafts_of_the_others_intact(
    verifiers: Any, backend: str, drafter_dir: Any
) -> None:
    verifier = verifiers["qwen3"]
    proposer = _load(backend, drafter_dir, verifier)
    decoder = Decoder(verifier, prefill_chunk_tokens=16)
    strategy = STRATEGIES["full"]
    expected = [_alone(decoder, seq, SESSIONS[i][1]) for i, seq in enumerate(_sequences(verifier, proposer, strategy))]
    seqs = _sequences(verifier, proposer, strategy)

    def corrupt(round_: int) -> None:
        if round_ == 4:
            seqs[2].cache._layers[0].held += 1  # type: ignore[attr-defined]  # its next commit finds the mismatch

    together, _ = _together(decoder, seqs, proposer, corrupt)
    assert isinstance(together[2], InvariantViolation) and together[2].kind == "inv1"
    assert [t for i, t in enumerate(together) if i != 2] == [t for i, t in enumerate(expected) if i != 2]
