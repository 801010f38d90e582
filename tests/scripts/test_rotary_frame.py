"""The rotary a torch verifier turns its keys by, read by `verifier_rotary` for f_θ's unrotated frame: turned back,
the keys of the same tokens at different positions are the same (what a position-free row can predict)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from inference_engine.config import BUNDLED_MODEL_DIR
from kv_cache_proposer.backends import load_verifier
from kv_cache_proposer.restoration.projection import kv_rows
from kv_cache_proposer.restoration.rebuild import forward_kv

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from lib.restoration import verifier_rotary  # noqa: E402


def test_keys_of_the_same_tokens_at_other_positions_agree_once_turned_back():
    verifier = load_verifier("torch", BUNDLED_MODEL_DIR, device="cpu", dtype="float32")
    rotary = verifier_rotary(verifier)
    assert rotary is not None and rotary.head_dim == 64 and rotary.scale == 1.0
    ops, tokens = verifier.array_ops, [5, 17, 42, 99, 7, 3, 250, 11]
    stored, turned_back = [], []
    for start in (0, 37, 1000):
        # Layer 0's K of a token depends on the token and its position alone: the rotary is all that differs.
        kv = forward_kv(verifier.forward_layers, ops, verifier.num_layers, tokens, start=start, last_layer=0)
        rows = kv_rows(ops.to_host(kv[0][0]), ops.to_host(kv[0][1]))
        keys, positions = rows[:, : rows.shape[1] // 2], np.arange(start, start + len(tokens))
        stored.append(keys)
        turned_back.append(rotary.turn(keys, positions, back=True))
        np.testing.assert_allclose(rotary.turn(turned_back[-1], positions), keys, atol=1e-4)
    assert not np.allclose(stored[1], stored[0], atol=1e-2)
    np.testing.assert_allclose(turned_back[1], turned_back[0], atol=1e-4)
    np.testing.assert_allclose(turned_back[2], turned_back[0], atol=1e-4)
