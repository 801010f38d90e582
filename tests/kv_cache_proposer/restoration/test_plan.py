"""Restoration plans as data: the manifest round trip, what a bad manifest raises, compact specs, and the
closed-form f_θ fit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kv_cache_proposer.restoration import LayerSource, LinearProjection, RestorationPlan, find_plan
from kv_cache_proposer.restoration.plan import plan_from_spec
from kv_cache_proposer.restoration.projection import kv_rows, rows_kv


def _projection(seed: int, width: int = 8) -> LinearProjection:
    rng = np.random.default_rng(seed)
    return LinearProjection(
        rng.normal(size=(width, width)).astype(np.float32), rng.normal(size=width).astype(np.float32)
    )


def test_a_plan_with_linear_maps_survives_the_manifest_round_trip(tmp_path):
    plan = RestorationPlan(
        (
            LayerSource("tokens"),
            LayerSource("projected", from_layer=3, projection=_projection(1)),
            LayerSource("projected", from_layer=3),
            LayerSource("kept"),
        ),
        verifier="tiny",
        notes={"recall": 1.0},
    )
    path = plan.save(tmp_path)
    assert path == find_plan(tmp_path) and path.with_suffix(".safetensors").is_file()
    loaded = RestorationPlan.load(tmp_path)
    assert loaded.describe() == "L0:tokens, L1:projected<-L3, L2:projected<-L3, L3:kept"
    assert loaded.verifier == "tiny" and loaded.notes == {"recall": 1.0}
    assert loaded.layers[2].projection is None
    original, read = plan.layers[1].projection, loaded.layers[1].projection
    assert original is not None and read is not None
    np.testing.assert_array_equal(read.weight, original.weight)
    np.testing.assert_array_equal(read.bias, original.bias)
    assert loaded.kept_layers == (3,) and loaded.kept_fraction == 0.25 and loaded.needs_tokens
    assert loaded.kept_compressor == "none" and "kept_compressor" not in json.loads(path.read_text())


def test_the_kept_layers_compressor_survives_the_manifest_round_trip(tmp_path):
    plan = RestorationPlan((LayerSource("tokens"), LayerSource("kept"))).with_kept_compressor("kakeya_d4:20")
    loaded = RestorationPlan.load(plan.save(tmp_path))
    assert loaded.kept_compressor == "kakeya_d4:20"
    assert loaded.describe() == "L0:tokens, L1:kept (kept: kakeya_d4:20)"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m.update(format="other/1"), "not a kakeya-restoration-plan"),
        (lambda m: m["layers"].__setitem__(0, {"source": "guess"}), "unknown restoration source"),
        (
            lambda m: m["layers"].__setitem__(1, {"source": "projected", "from": {"kind": "hidden_state"}}),
            "not supported",
        ),
        (lambda m: m.update(proposer="other-model"), "only the verifier checkpoint"),
        (lambda m: m.update(weights="missing.safetensors"), "cannot read restoration weights"),
        (lambda m: m.update(kept_compressor="zip"), "unknown KV compressor 'zip'"),
    ],
)
def test_a_bad_manifest_raises_a_value_error_naming_the_problem(tmp_path, mutate, message):
    path = RestorationPlan.uniform(2, "kept").save(tmp_path / "plan.json")
    manifest = json.loads(path.read_text())
    mutate(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=message):
        RestorationPlan.load(path)


def test_a_projection_must_read_a_kept_layer():
    with pytest.raises(ValueError, match="not kept"):
        RestorationPlan((LayerSource("tokens"), LayerSource("projected", from_layer=0)))
    with pytest.raises(ValueError, match="names what it projects from"):
        LayerSource("projected")
    with pytest.raises(ValueError, match="names what it projects from"):
        LayerSource("projected", from_layer=1, from_drafter=True)


def test_compact_specs_build_plans_and_reject_what_they_cannot_mean():
    assert plan_from_spec("recompute", 3).describe() == "L0:recompute, L1:recompute, L2:recompute"
    assert plan_from_spec("tokens,projected<-2,kept", 3).describe() == "L0:tokens, L1:projected<-L2, L2:kept"
    for bad in ("tokens,kept", "tokens,guess,kept", "tokens,projected<-x,kept", "tokens,projected<-drafter,kept"):
        with pytest.raises(ValueError):
            plan_from_spec(bad, 3)


def test_least_squares_recovers_a_linear_map_between_kv_rows():
    rng = np.random.default_rng(0)
    truth = _projection(2)
    source = rng.normal(size=(500, 8)).astype(np.float32)
    fitted = LinearProjection.fit(source, truth.apply(source), ridge=0.0)
    np.testing.assert_allclose(fitted.apply(source), truth.apply(source), atol=1e-3)


def test_kv_rows_and_back_are_inverse():
    rng = np.random.default_rng(1)
    keys, values = rng.normal(size=(1, 2, 5, 3)), rng.normal(size=(1, 2, 5, 3))
    rows = kv_rows(keys, values)
    assert rows.shape == (5, 12)
    back_keys, back_values = rows_kv(rows, 2, 3)
    np.testing.assert_array_equal(back_keys, keys)
    np.testing.assert_array_equal(back_values, values)
