"""Restoration plans as data: the manifest round trip, what a bad manifest raises, compact specs, and the
closed-form f_θ fit, as stored and in the keys' unrotated frame."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kv_cache_proposer.restoration import LayerSource, LinearProjection, RestorationPlan, Rotary, find_plan
from kv_cache_proposer.restoration.drafter_context import DrafterContext
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


def _rotary(head_dim: int = 8) -> Rotary:
    return Rotary((10000.0 ** -(np.arange(0, head_dim, 2) / head_dim)).astype(np.float32))


def test_turning_keys_to_their_positions_and_back_is_the_identity_and_keeps_their_length():
    rng = np.random.default_rng(3)
    keys, positions = rng.normal(size=(40, 16)).astype(np.float32), rng.integers(0, 8192, size=40)
    turned = _rotary().turn(keys, positions)
    assert not np.allclose(turned, keys)
    np.testing.assert_allclose(np.linalg.norm(turned, axis=1), np.linalg.norm(keys, axis=1), rtol=1e-5)
    np.testing.assert_allclose(_rotary().turn(turned, positions, back=True), keys, atol=1e-4)
    np.testing.assert_array_equal(_rotary().turn(keys, np.zeros(40, dtype=np.int64)), keys)


def test_a_map_in_the_unrotated_frame_predicts_turned_keys_that_a_map_of_stored_keys_cannot():
    """Keys that are a linear function of a position-free row before their rotation (as a verifier computes them):
    f_θ in the unrotated frame recovers them at any position; f_θ of the keys as stored predicts little more than
    their mean."""
    rng = np.random.default_rng(4)
    rotary, width, heads_dim = _rotary(), 12, 16  # 2 heads of 8: a K/V row of 32 values
    truth = rng.normal(size=(width, 2 * heads_dim)).astype(np.float32)
    source = rng.normal(size=(3000, width)).astype(np.float32)
    positions = rng.integers(0, 4096, size=3000)
    target = source @ truth
    target[:, :heads_dim] = rotary.turn(target[:, :heads_dim], positions)
    unrotated = LinearProjection.fit(source, target, ridge=0.0, rotary=rotary, positions=positions)
    stored = LinearProjection.fit(source, target, ridge=0.0)
    np.testing.assert_allclose(unrotated.apply(source, positions), target, atol=1e-3)
    key_error = np.sum((stored.apply(source)[:, :heads_dim] - target[:, :heads_dim]) ** 2)
    assert key_error / np.sum(target[:, :heads_dim] ** 2) > 0.5
    with pytest.raises(ValueError, match="positions"):
        unrotated.apply(source)


def test_a_map_between_layers_turns_the_source_keys_back_before_it():
    rng = np.random.default_rng(5)
    rotary, heads_dim = _rotary(), 16
    truth = rng.normal(size=(2 * heads_dim, 2 * heads_dim)).astype(np.float32)
    plain = rng.normal(size=(3000, 2 * heads_dim)).astype(np.float32)
    positions = rng.integers(0, 4096, size=3000)
    target = plain @ truth
    source, target[:, :heads_dim] = plain.copy(), rotary.turn(target[:, :heads_dim], positions)
    source[:, :heads_dim] = rotary.turn(plain[:, :heads_dim], positions)
    fitted = LinearProjection.fit(source, target, ridge=0.0, rotary=rotary, positions=positions, reads_keys=True)
    np.testing.assert_allclose(fitted.apply(source, positions), target, atol=1e-3)


def test_maps_in_the_unrotated_frame_survive_the_manifest_round_trip_with_the_rotary(tmp_path):
    rng = np.random.default_rng(6)
    drafter = DrafterContext((0,), rng.normal(size=(12, 12)).astype(np.float32), np.ones(12, np.float32), 1e-6)
    rotary = Rotary(_rotary().inv_freq, scale=1.25)
    between = _projection(8, 32)
    from_layer = LinearProjection(between.weight, between.bias, rotary, reads_keys=True)
    from_drafter = LinearProjection(rng.normal(size=(12, 32)).astype(np.float32), np.zeros(32, np.float32), rotary)
    plan = RestorationPlan(
        (
            LayerSource("kept"),
            LayerSource("projected", from_layer=0, projection=from_layer),
            LayerSource("projected", projection=from_drafter, from_drafter=True),
            LayerSource("projected", from_layer=0, projection=_projection(9, 32)),
        ),
        drafter=drafter,
    )
    loaded = RestorationPlan.load(plan.save(tmp_path))
    manifest = json.loads((tmp_path / "restore_plan.json").read_text())
    frames = [entry.get("projection", {}).get("frame") for entry in manifest["layers"]]
    assert frames == [None, "unrotated", "unrotated", None]
    read = loaded.rotary
    assert read is not None and read.scale == 1.25 and np.array_equal(read.inv_freq, rotary.inv_freq)
    maps = [source.projection for source in loaded.layers[1:]]
    frames_read = [(m.rotary is not None, m.reads_keys) for m in maps if m is not None]
    assert frames_read == [(True, True), (True, False), (False, False)]
    rows, positions = rng.normal(size=(5, 32)).astype(np.float32), np.arange(100, 105)
    first, original = maps[0], plan.layers[1].projection
    assert first is not None and original is not None
    np.testing.assert_array_equal(first.apply(rows, positions), original.apply(rows, positions))
    del manifest["rotary"]
    (tmp_path / "restore_plan.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="names no `rotary`"):
        RestorationPlan.load(tmp_path)
