"""Decode-step controls on both backends: grammar drafts and masks, stop sequences across steps, min-p and
penalties against direct computations."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from kv_cache_proposer.controls import DecodeControls, Penalties, match_stop_sequence
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState, StopCause
from kv_cache_proposer.grammar import GrammarCompiler, GrammarKind, GrammarSpec
from kv_cache_proposer.sampling import SamplingParams, log_probs, pick_tokens
from kv_cache_proposer.strategies import FullStrategy
from tests.support.backends import BACKENDS
from tests.support.checkpoints import VOCAB_SIZE
from tests.support.tokenizers import save_test_tokenizer

PROMPT = [7, 30, 12, 44, 9, 61]


class ScriptedDraft:
    """Drafts a fixed script of the continuation in blocks of `block` tokens (a perfect drafter)."""

    feature_layers = ()
    nbytes = 0

    def __init__(self, script: list[int], prompt_len: int, block: int = 3) -> None:
        self.script = script
        self.prompt_len = prompt_len
        self.max_draft_tokens = block
        self.proposed: list[list[int]] = []

    def propose(self, history: Sequence[int], max_tokens: int) -> list[int]:
        offset = len(history) - self.prompt_len
        draft = list(self.script[offset : offset + max_tokens])
        self.proposed.append(draft)
        return draft

    def on_commit(self, history: Sequence[int], committed: int, features) -> None:
        return None

    def release(self) -> None:
        return None


def _run(decoder: Decoder, seq: SequenceState, budget: GenerationBudget, controls: DecodeControls | None = None):
    tokens, steps = [], []
    while True:
        step = decoder.step(seq, SamplingParams(), budget, len(tokens), controls)
        steps.append(step)
        tokens += step.tokens
        if step.stop is not None:
            return tokens, steps


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: pytest.TempPathFactory) -> GrammarCompiler:
    directory: Path = save_test_tokenizer(tmp_path_factory.mktemp("tok"))
    return GrammarCompiler.from_model_dir(directory, VOCAB_SIZE, cache_size=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stop_sequence_spanning_two_speculative_blocks_is_found(verifiers, backend):
    decoder = Decoder(verifiers["qwen3"])
    plain = SequenceState(cache=decoder.verifier.new_cache(FullStrategy()), tokens=list(PROMPT))
    free, _ = _run(decoder, plain, GenerationBudget(max_new_tokens=16))
    draft = ScriptedDraft(free, len(PROMPT))
    seq = SequenceState(cache=decoder.verifier.new_cache(FullStrategy()), tokens=list(PROMPT), draft_session=draft)
    _, steps = _run(decoder, seq, GenerationBudget(max_new_tokens=16))
    boundary = len(steps[0].tokens)  # the first step's last token and the second step's first tokens
    assert 1 < boundary < len(free) - 2
    stop = tuple(free[boundary - 1 : boundary + 2])
    first_end = next(i + 3 for i in range(len(free) - 2) if tuple(free[i : i + 3]) == stop)
    seq = SequenceState(
        cache=decoder.verifier.new_cache(FullStrategy()),
        tokens=list(PROMPT),
        draft_session=ScriptedDraft(free, len(PROMPT)),
    )
    tokens, steps = _run(decoder, seq, GenerationBudget(max_new_tokens=16), DecodeControls(stop_sequences=((1,), stop)))
    if 1 in free[:first_end]:
        pytest.skip("the random model generated the single-token stop sequence")
    assert tokens == free[:first_end]
    assert steps[-1].stop is StopCause.STOP_SEQUENCE and steps[-1].stop_sequence_index == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_draft_tokens_the_grammar_forbids_are_cut_before_verification(verifiers, compiler, backend):
    decoder = Decoder(verifiers["llama"])
    spec = GrammarSpec(GrammarKind.REGEX, "[a-c]{6}")
    letters = [ord(c) - 33 + 3 for c in "abcabc"]  # byte-level ids of the test tokenizer
    script = [letters[0], letters[1], 5, letters[3], letters[4], letters[5]]  # the third token breaks the grammar
    draft = ScriptedDraft(script, len(PROMPT), block=4)
    seq = SequenceState(cache=decoder.verifier.new_cache(FullStrategy()), tokens=list(PROMPT), draft_session=draft)
    controls = DecodeControls(grammar=compiler.start(spec))
    step = decoder.step(seq, SamplingParams(), GenerationBudget(max_new_tokens=10), 0, controls)
    assert draft.proposed[0] == script[:4]
    assert step.drafted == 2, "only the grammar-valid prefix of the draft reaches the verifier"
    assert all(t in letters[:3] for t in step.tokens)
    # The grammar state moved past exactly the emitted tokens: the rest of the output completes the sentence.
    tokens, _ = _run(decoder, seq, GenerationBudget(max_new_tokens=20, stop_token_ids=compiler.eos_token_ids), controls)
    assert len(step.tokens + tokens) == 7 and tokens[-1] in compiler.eos_token_ids


def test_masks_along_a_draft_leave_the_committed_grammar_state_unchanged(compiler):
    state = compiler.start(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "boolean"})))
    before = state.masks_along([])
    t = ord("t") - 33 + 3
    masks = state.masks_along([t])
    assert (masks[0] == before[0]).all() and not (masks[1] == before[0]).all()
    assert (state.masks_along([])[0] == before[0]).all()


def test_compiled_grammars_are_cached_per_grammar_and_evicted_least_recently_used(compiler):
    specs = [GrammarSpec(GrammarKind.REGEX, pattern) for pattern in ("x+", "y+", "z+")]
    start = compiler.compiled_count
    compiler.start(specs[0])
    compiler.start(specs[0])
    assert compiler.compiled_count == start + 1
    compiler.start(specs[1])
    compiler.start(specs[2])  # cache_size 2: the least recently used (x+) is dropped
    compiler.start(specs[2])
    assert compiler.compiled_count == start + 3
    compiler.start(specs[0])
    assert compiler.compiled_count == start + 4


def test_min_p_keeps_exactly_the_tokens_at_least_min_p_times_as_likely_as_the_best():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(1, 40)) * 2
    params = SamplingParams(temperature=0.8, min_p=0.2, seed=9)
    probs = np.exp(logits[0] / 0.8 - (logits[0] / 0.8).max())
    probs /= probs.sum()
    kept = probs >= 0.2 * probs.max()
    picks = pick_tokens(np.repeat(logits, 400, axis=0), params, range(400))
    assert set(picks) == set(np.flatnonzero(kept))
    expected = np.where(kept, np.log(probs / probs[kept].sum()), -np.inf)
    np.testing.assert_allclose(log_probs(logits, params)[0], expected, atol=1e-12)


def test_penalties_follow_the_documented_formula_over_the_window():
    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0])
    Penalties(repetition=2.0, presence=0.5, frequency=0.25, window_tokens=4).apply(logits, [3, 0, 1, 1, 4, 1])
    # The window is [1, 1, 4, 1]: token 1 three times, token 4 once; tokens 0 and 3 fell out of it.
    np.testing.assert_allclose(logits, [2.0, -1.0 * 2 - 0.75 - 0.5, 0.5, 3.0, -2.0 * 2 - 0.25 - 0.5])


def test_match_stop_sequence_reports_the_first_listed_match():
    assert match_stop_sequence([1, 2, 3], [(9,), (2, 3), (3,)]) == 1
    assert match_stop_sequence([1, 2, 3], [(1, 2)]) is None
