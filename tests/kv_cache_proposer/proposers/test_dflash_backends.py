"""One DFlash drafter directory on both backends: the same layer features, the same drafts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kv_cache_proposer.proposers.dflash.mlx_proposer import MlxDFlashProposer
from kv_cache_proposer.proposers.dflash.proposer import DFlashProposer
from kv_cache_proposer.strategies import FullStrategy, SinkWindowStrategy
from tests.support.backends import to_numpy
from tests.support.checkpoints import VOCAB_SIZE, save_dflash_drafter


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return save_dflash_drafter(tmp_path_factory.mktemp("dflash") / "drafter", block_size=6)


@pytest.mark.parametrize("strategy", [FullStrategy(), SinkWindowStrategy(sink=2, window=12)], ids=["full", "sink"])
def test_both_backends_capture_the_same_features_and_draft_the_same_tokens(verifier_pool, drafter_dir, strategy):
    verifiers = {backend: verifier_pool.get(backend, "qwen3") for backend in ("torch", "mlx")}
    proposers = {
        "torch": DFlashProposer.load(drafter_dir, verifiers["torch"]),
        "mlx": MlxDFlashProposer.load(drafter_dir, verifiers["mlx"]),
    }
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
