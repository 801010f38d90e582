"""One DFlash drafter directory on both backends: the same layer features, the same drafts."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kv_cache_proposer.cache import KVSessionCache
from kv_cache_proposer.proposers.dflash.mlx_proposer import MlxDFlashProposer
from kv_cache_proposer.proposers.dflash.proposer import DFlashProposer
from kv_cache_proposer.proposers.dflash.session import PENDING_POSITIONS, DFlashDraftSession
from kv_cache_proposer.strategies import FullStrategy, SinkWindowStrategy
from tests.support.backends import to_numpy
from tests.support.checkpoints import VOCAB_SIZE, save_dflash_drafter


def _on_both_backends(verifier_pool: Any, directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The qwen3 test verifier of each backend and the drafter in `directory` loaded over it."""
    verifiers = {backend: verifier_pool.get(backend, "qwen3") for backend in ("torch", "mlx")}
    return verifiers, {
        "torch": DFlashProposer.load(directory, verifiers["torch"]),
        "mlx": MlxDFlashProposer.load(directory, verifiers["mlx"]),
    }


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return save_dflash_drafter(tmp_path_factory.mktemp("dflash") / "drafter", block_size=6)


@pytest.mark.parametrize("strategy", [FullStrategy(), SinkWindowStrategy(sink=2, window=12)], ids=["full", "sink"])
def test_both_backends_capture_the_same_features_and_draft_the_same_tokens(verifier_pool, drafter_dir, strategy):
    verifiers, proposers = _on_both_backends(verifier_pool, drafter_dir)
    rng = random.Random(3)
    tokens = [rng.randrange(VOCAB_SIZE - 1) for _ in range(40)]
    layers = proposers["torch"].spec.target_layer_ids
    features, drafts = {}, {}
    for backend, verifier in verifiers.items():
        out = verifier.verify(verifier.new_cache(strategy), tokens, 1, feature_layers=layers)
        features[backend] = to_numpy(out.features)
        session = proposers[backend].open(strategy)
        drafts[backend] = []
        for end in range(20, 40, 5):  # context arrives as the decoder commits it, drafting after each commit
            session.on_commit(tokens, end, out.features[end - 5 if end > 20 else 0 : end])
            drafts[backend].append(session.propose(tokens[: end + 1], 5))
        session.release()
    assert features["torch"].shape == (40, 2 * verifiers["torch"].hidden_size)
    np.testing.assert_allclose(features["mlx"], features["torch"], atol=1e-4, rtol=1e-4)
    assert drafts["mlx"] == drafts["torch"] and all(len(d) == 5 for d in drafts["torch"])


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_features_follow_the_output_hidden_states_convention_including_the_last_layer(verifier_pool, backend):
    # Feature i is transformers' hidden_states[i + 1]: layer i's output, but the final norm's for the last layer.
    reference = verifier_pool.get("torch", "qwen3").model
    verifier = verifier_pool.get(backend, "qwen3")
    last = reference.config.num_hidden_layers - 1
    layers = (0, last)
    rng = random.Random(5)
    tokens = [rng.randrange(VOCAB_SIZE - 1) for _ in range(30)]
    with torch.no_grad():
        hidden = reference(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[i + 1][0] for i in layers], dim=-1).numpy()
    cache = verifier.new_cache(FullStrategy())
    out = verifier.verify(cache, tokens[:20], 1, feature_layers=layers)  # a prefill, then a block after it
    verifier.commit(cache, 20)
    more = verifier.verify(cache, tokens[20:], 1, feature_layers=layers)
    got = np.concatenate([to_numpy(out.features), to_numpy(more.features)])
    raw_last = hidden[last][0].numpy()  # the last layer's input: differs from its output and from the normed output
    assert not np.allclose(expected[:, -raw_last.shape[1] :], raw_last, atol=1e-3)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def windowed_drafter_dir(tmp_path_factory):
    return save_dflash_drafter(
        tmp_path_factory.mktemp("dflash") / "windowed",
        block_size=5,
        layers=2,
        sliding_window=8,
        every_layer_windowed=True,
    )


def test_a_windowed_drafter_holds_its_window_alone_and_drafts_as_over_the_whole_context(
    verifier_pool, windowed_drafter_dir
):
    # Every layer reads 8 positions back at most, so a session's drafter context holds those alone (bounded
    # whatever the history) and drafts exactly what a context holding every position drafts; both backends agree.
    verifiers, proposers = _on_both_backends(verifier_pool, windowed_drafter_dir)
    rng = random.Random(11)
    tokens = [rng.randrange(VOCAB_SIZE - 1) for _ in range(60)]
    layers = proposers["torch"].spec.target_layer_ids
    drafts: dict[str, list[list[int]]] = {}
    for backend, verifier in verifiers.items():
        proposer = proposers[backend]
        out = verifier.verify(verifier.new_cache(FullStrategy()), tokens, 1, feature_layers=layers)
        bounded = proposer.open(FullStrategy())
        whole = DFlashDraftSession(proposer, KVSessionCache(FullStrategy(), num_layers=2, ops=verifier.array_ops))
        drafts[backend] = []
        for session in (bounded, whole):
            session.on_commit(tokens, 30, out.features[:30])  # a prefill far longer than the window
            made = []
            for end in range(30, 60, 6):
                if end > 30:
                    session.on_commit(tokens, end, out.features[end - 6 : end])
                made.append(session.propose(tokens[: end + 1], 4))
            drafts[backend].append(made)
        assert bounded._cache.resident_count <= 8 < whole._cache.resident_count
        assert drafts[backend][0] == drafts[backend][1], backend
        # A fork before the window keeps what it still holds (nothing) and drafts on as its context refills.
        fork = bounded.clone(40)
        assert fork._cache.next_position == 40 and fork._cache.resident_count == 0
        fork.on_commit(tokens, 50, out.features[40:50])
        assert len(fork.propose(tokens[:51], 4)) == 4
        for session in (bounded, whole, fork):
            session.release()
    assert drafts["mlx"] == drafts["torch"]


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_features_wait_for_the_next_proposal_and_are_projected_once_in_one_call(verifier_pool, drafter_dir, backend):
    # A session that commits step after step without drafting (the `cost` policy declining) keeps the features and
    # projects them in one call before it drafts; it drafts what a session projecting at every commit drafts.
    verifier = verifier_pool.get(backend, "qwen3")
    loader = DFlashProposer if backend == "torch" else MlxDFlashProposer
    proposer = loader.load(drafter_dir, verifier)
    rng = random.Random(5)
    tokens = [rng.randrange(VOCAB_SIZE - 1) for _ in range(40)]
    out = verifier.verify(verifier.new_cache(FullStrategy()), tokens, 1, feature_layers=proposer.spec.target_layer_ids)
    eager, waiting = proposer.open(FullStrategy()), proposer.open(FullStrategy())
    eager_drafts = []
    for end in range(20, 40, 2):
        eager.on_commit(tokens, end, out.features[end - 2 if end > 20 else 0 : end])
        eager_drafts.append(eager.propose(tokens[: end + 1], 4))  # settles at each proposal: one call per commit
    before = proposer.context_projections
    bytes_parked = waiting.nbytes
    for end in range(20, 40, 2):
        waiting.on_commit(tokens, end, out.features[end - 2 if end > 20 else 0 : end])
    assert proposer.context_projections == before  # nothing projected yet
    assert waiting.nbytes > bytes_parked  # the waiting features count in the session's bytes
    assert waiting.propose(tokens[:21], 4) == []  # the history does not continue what it holds: no draft
    fork = waiting.clone(30)  # a fork projects what waits first, and holds its first 30 positions
    assert proposer.context_projections == before + 1
    assert waiting.propose(tokens[:39], 4) == eager_drafts[-1]
    assert proposer.context_projections == before + 1
    fork.on_commit(tokens, 38, out.features[30:38])
    assert fork.propose(tokens[:39], 4) == eager_drafts[-1]
    # However long a session declines, what waits stays bounded.
    bounded = proposer.open(FullStrategy())
    long_tokens = [rng.randrange(VOCAB_SIZE - 1) for _ in range(PENDING_POSITIONS + 8)]
    long_out = verifier.verify(
        verifier.new_cache(FullStrategy()), long_tokens, 1, feature_layers=proposer.spec.target_layer_ids
    )
    before = proposer.context_projections
    for end in range(1, len(long_tokens) + 1):
        bounded.on_commit(long_tokens, end, long_out.features[end - 1 : end])
    assert proposer.context_projections == before + 1 and bounded._cache.next_position == PENDING_POSITIONS
    for session in (eager, waiting, fork, bounded):
        session.release()
