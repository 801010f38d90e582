"""Attention-output distillation of f_θ (`scripts/lib/distill.py`) on the bundled model: from a poor start it cuts
the held-out error of the attention output, and a map that training makes worse there keeps its start."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

from inference_engine.config import BUNDLED_MODEL_DIR
from kv_cache_proposer.backends import load_verifier
from kv_cache_proposer.restoration.plan import plan_from_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from lib.distill import DistillSettings, collect_queries, distill_plan
from lib.restoration import fit_projections, kv_rows_by_layer

SPEC = "tokens,kept,projected<-1,kept"


@pytest.fixture(scope="module")
def training():
    verifier = load_verifier("torch", BUNDLED_MODEL_DIR, device="cpu", dtype="float32")
    rng = random.Random(0)
    texts = [[rng.randrange(1000) for _ in range(96)] for _ in range(12)]
    return verifier, texts, kv_rows_by_layer(verifier, texts, range(4))


def test_the_queries_are_those_attention_reads_one_per_query_head_and_position(training):
    verifier, texts, _ = training
    queries = collect_queries(verifier, texts[:2], [1, 2])
    assert set(queries.by_layer) == {1, 2} and queries.by_layer[2].shape == (2, 3, 96, 64)  # 3 query heads of 64
    assert queries.scaling == {1: 0.125, 2: 0.125}  # 64 ** -0.5
    assert verifier.model.config._attn_implementation == "sdpa"  # the capture is undone


def test_distillation_cuts_the_held_out_attention_error_of_a_poor_start(training):
    verifier, texts, rows = training
    shrunk, _ = fit_projections(plan_from_spec(SPEC, 4), rows, ridge=10.0)
    distilled, report = distill_plan(verifier, shrunk, rows, texts, DistillSettings(sink=2, window=9, steps=200))
    assert report["L1->L2"]["distilled"] < 0.7 * report["L1->L2"]["least_squares"]
    start, trained = shrunk.layers[2].projection, distilled.layers[2].projection
    assert start is not None and trained is not None and not np.allclose(trained.weight, start.weight)


def test_a_map_that_training_makes_worse_held_out_keeps_its_start(training):
    verifier, texts, rows = training
    fitted, _ = fit_projections(plan_from_spec(SPEC, 4), rows, ridge=1e-3)
    settings = DistillSettings(sink=2, window=9, steps=50, lr=0.1)  # a step too large for 11 short texts
    distilled, report = distill_plan(verifier, fitted, rows, texts, settings)
    assert report["L1->L2"]["distilled"] > report["L1->L2"]["least_squares"]
    assert distilled.layers[2].projection is fitted.layers[2].projection
