"""The KakeyaLattice codec and bit layout: indices, packing and escapes round-trip; torch decoding is the reference
`roundtrip()` bit for bit, on random and on the bundled model's real K/V; the MLX port agrees with it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kv_cache_proposer.backends import load_verifier
from kv_cache_proposer.backends.torch_backend.lattice_codec import TorchLatticeCodec, coding_matches
from kv_cache_proposer.compression import KVCompressor, LatticeSpec, lattice
from kv_cache_proposer.compression.lattice import block_indices, block_points, pack_codes, unpack_codes
from kv_cache_proposer.strategies import FullStrategy

BUNDLED = Path(__file__).resolve().parents[3] / "inference_engine" / "models" / "kakeya-tiny"
LATTICES = [("d4", 38), ("d4", 10), ("d4", 1), ("d4", 200), ("e8", 38), ("e8", 10), ("e8", 116)]


def _vectors(seed: int, n: int = 2000, dim: int = 64) -> torch.Tensor:
    """Gaussian vectors at many scales, with outlier coordinates (what K vectors look like after RoPE)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen) * torch.rand(n, 1, generator=gen) * 4
    x[::5, 3] *= 30
    return x


@pytest.mark.parametrize(("kind", "q_range"), LATTICES)
def test_block_indices_and_packing_round_trip_every_lattice_point_and_flag_only_clamped_blocks(kind, q_range):
    spec = LatticeSpec(kind, 64, q_range)
    codec = TorchLatticeCodec(spec, torch.device("cpu"))
    coding = codec.encode(_vectors(1))
    indices, escaped = block_indices(spec, coding.doubled)
    assert indices.max() < 2**spec.bits_per_block
    packed = pack_codes(spec, indices)
    assert packed.shape == (coding.count, spec.code_bytes)
    assert np.array_equal(unpack_codes(spec, packed), indices)
    # The layout: a vector's blocks follow one another, `bits_per_block` bits each, in one little-endian number.
    for row in range(0, coding.count, 97):
        number = int.from_bytes(packed[row].tobytes(), "little")
        mask = (1 << spec.bits_per_block) - 1
        assert [(number >> (k * spec.bits_per_block)) & mask for k in range(spec.blocks)] == indices[row].tolist()
    points = block_points(spec, indices).reshape(-1, spec.blocks, spec.block_dim)
    blocks = coding.doubled.reshape(-1, spec.blocks, spec.block_dim)
    assert np.array_equal(points[~escaped], blocks[~escaped])
    # An escaped block really is off the lattice: its coordinates mix cosets or its integer sum is odd.
    for block in blocks[escaped][:50]:
        coords = block.astype(np.int64)
        integral = (coords % 2 == 0).all()
        half = (coords % 2 == 1).all()
        assert not (
            (integral and (coords // 2).sum() % 2 == 0) or (kind == "e8" and half and coords.sum() // 2 % 2 == 0)
        )


@pytest.mark.parametrize("q_range", [1, 38, lattice.D4_NARROW_Q])
def test_narrow_d4_indices_and_points_are_the_general_ones_off_the_lattice_too(monkeypatch, q_range):
    spec = LatticeSpec("d4", 64, q_range)
    rng = np.random.default_rng(q_range)
    # Lattice points, odd sums, half-integers and coordinates beyond the range, at every block.
    doubled = rng.integers(-2 * q_range - 3, 2 * q_range + 4, size=(3000, 64)).astype(np.int16)
    doubled[::3] &= ~1
    narrow = block_indices(spec, doubled)
    indices = rng.integers(0, ((2 * q_range + 1) ** 4 + 1) // 2, size=(3000, spec.blocks))
    points = block_points(spec, indices)
    monkeypatch.setattr(lattice, "D4_NARROW_Q", 0)
    general = block_indices(spec, doubled)
    assert np.array_equal(narrow[0], general[0]) and np.array_equal(narrow[1], general[1])
    assert 0 < narrow[1].mean() < 1  # some blocks escape, some do not
    assert np.array_equal(points, block_points(spec, indices))


def test_the_bit_budget_is_the_spec_formula():
    assert LatticeSpec("d4", 128, 38).bits_per_vector == 832
    assert LatticeSpec("e8", 128, 38).bits_per_vector == 848
    assert LatticeSpec("e8", 128, 37).bits_per_vector == 832
    assert LatticeSpec("d4", 64, 38).bits_per_vector == 16 * 25 + 32
    assert LatticeSpec("d4", 64, 10).bits_per_vector == 16 * 17 + 32
    assert LatticeSpec("d4", 64, 10, one_scale=True).bits_per_vector == 16 * 17 + 16  # 4.5 bits per value
    assert LatticeSpec("e8", 128, 37, one_scale=True).bits_per_vector == 816
    assert KVCompressor("kakeya_d4s", 10).spec(64) == LatticeSpec("d4", 64, 10, one_scale=True)
    assert KVCompressor.parse("kakeya_e8s:37").spec(64).one_scale
    assert not KVCompressor.parse("kakeya_e8:37").spec(64).one_scale


@pytest.mark.parametrize(("kind", "q_range"), LATTICES)
def test_torch_decoding_equals_the_reference_roundtrip_bit_for_bit_on_random_vectors(kind, q_range):
    codec = TorchLatticeCodec(LatticeSpec(kind, 64, q_range), torch.device("cpu"))
    vectors = torch.cat([_vectors(2), _tie_vectors()])
    assert coding_matches(codec, vectors)
    assert coding_matches(codec, vectors[:3])  # batch size does not change a vector's decoding


def _tie_vectors(dim: int = 64) -> torch.Tensor:
    """Vectors whose scaled rotation lands exactly on integers (Hadamard rows: a one-hot rotation, so an odd Q
    gives an odd block sum with no rounding error anywhere, the search's tie), and zero vectors."""
    rows = LatticeSpec("d4", dim, 1)
    hadamard = TorchLatticeCodec(rows, torch.device("cpu")).reference.H
    return torch.cat([hadamard * 3.0, -hadamard[:8], torch.zeros(4, dim)])


@pytest.mark.parametrize(("kind", "q_range"), LATTICES)
def test_a_forwards_block_coding_decodes_to_the_reference_roundtrip_ties_and_zero_vectors_included(kind, q_range):
    codec = TorchLatticeCodec(LatticeSpec(kind, 64, q_range), torch.device("cpu"))
    vectors = torch.cat([_vectors(5, n=300), _tie_vectors()])
    half = vectors.shape[0] // 2
    keys, values = vectors[:half].reshape(1, 1, half, 64), vectors[half : 2 * half].reshape(1, 1, half, 64)
    ((decoded_keys, decoded_values, coding),) = codec.code_blocks([(keys, values)], torch.float32)
    reference = codec.reference.roundtrip(vectors[: 2 * half])
    assert torch.equal(torch.cat([decoded_keys, decoded_values]).reshape(-1, 64), reference)
    assert torch.equal(coding.doubled.reshape(-1, 64), torch.from_numpy(codec.encode(vectors[: 2 * half]).doubled))
    # A decode step codes one vector of K and V per layer, every layer in one call: the same values and codes.
    steps = [
        (vectors[one].reshape(1, 1, 1, 64), vectors[(one + 1) % (2 * half)].reshape(1, 1, 1, 64))
        for one in range(0, 2 * half, 37)
    ]
    coded = codec.code_blocks(steps, torch.float32)
    for (k, _), (step_keys, step_values, step_coding) in zip(steps, coded, strict=True):
        one = int(torch.nonzero((vectors == k.reshape(64)).all(dim=1))[0])
        assert torch.equal(step_keys.reshape(64), reference[one])
        # The reference over the whole batch: a one-row product may round otherwise on some CPUs (MKL's GEMV).
        assert torch.equal(step_values.reshape(64), reference[(one + 1) % (2 * half)])
        assert torch.equal(step_coding.doubled[0].reshape(64), coding.doubled.reshape(-1, 64)[one])


def _captured_kv() -> torch.Tensor:
    """K and V of every layer of the bundled model after a real forward over 200 tokens, as `[N, 64]`."""
    verifier = load_verifier("torch", BUNDLED, device="cpu", dtype="float32")
    cache = verifier.new_cache(FullStrategy())
    tokens = np.random.default_rng(3).integers(3, verifier.vocab_size, 200).tolist()
    verifier.verify(cache, tokens, 1)
    cache.commit(len(tokens))
    parts = []
    for layer in range(cache.num_layers):
        keys, values, _ = cache.resident_kv(layer)
        parts += [keys.reshape(-1, 64), values.reshape(-1, 64)]
    return torch.cat(parts)


@pytest.mark.parametrize("kind", ["d4", "e8"])
def test_torch_decoding_equals_the_reference_roundtrip_on_the_bundled_models_kv_escapes_included(kind):
    vectors = _captured_kv()
    spec = LatticeSpec(kind, 64, 38)
    codec = TorchLatticeCodec(spec, torch.device("cpu"))
    coding = codec.encode(vectors)
    _, escaped = block_indices(spec, coding.doubled)
    if kind == "e8":
        assert escaped.any()  # the real K/V do exercise the escape path
    assert coding_matches(codec, vectors)


@pytest.mark.parametrize("one_scale", [False, True], ids=["two-scales", "one-scale"])
@pytest.mark.parametrize(("kind", "q_range"), LATTICES)
def test_the_mlx_codec_gives_the_torch_codes_and_values_within_one_fp16_step_of_the_norm(kind, q_range, one_scale):
    mx = pytest.importorskip("mlx.core", reason="the MLX port is compared only where mlx is installed")
    from kv_cache_proposer.backends.mlx_backend.lattice_codec import MlxLatticeCodec

    spec = LatticeSpec(kind, 64, q_range, one_scale=one_scale)
    vectors = _vectors(4)
    reference = TorchLatticeCodec(spec, torch.device("cpu"))
    port = MlxLatticeCodec(spec)
    torch_coding = reference.encode(vectors)
    mlx_coding = port.encode(mx.array(vectors.numpy()))
    same_codes = (torch_coding.doubled == mlx_coding.doubled).all(axis=1)
    assert same_codes.mean() >= 0.999
    torch_values = reference.decode(torch_coding, (2000, 64), torch.float32).numpy()
    mlx_values = np.array(port.decode(mlx_coding, (2000, 64), mx.float32))
    # Tolerance: an fp16 rounding step (2^-10 relative) of the stored norm or scale, plus float32 noise.
    error = np.abs(mlx_values - torch_values)[same_codes].max(axis=1)
    norms = np.linalg.norm(vectors.numpy(), axis=1)[same_codes]
    assert (error <= 2.0**-9 * norms + 1e-5).all()


ONE_SCALE = [("d4", 10), ("d4", 38), ("e8", 37)]


@pytest.mark.parametrize(("kind", "q_range"), ONE_SCALE)
def test_one_scale_codes_decode_to_their_scaled_rotation_with_the_error_of_the_two_scale_codes(kind, q_range):
    one = TorchLatticeCodec(LatticeSpec(kind, 64, q_range, one_scale=True), torch.device("cpu"))
    two = TorchLatticeCodec(LatticeSpec(kind, 64, q_range), torch.device("cpu"))
    vectors = torch.cat([_vectors(6), _tie_vectors()])
    coding = one.encode(vectors)
    assert (coding.norms == 1).all()  # no norm: the scale alone carries the size
    lattice = torch.from_numpy(coding.doubled).float() / 2
    scale = torch.from_numpy(coding.qmax).float().reshape(-1, 1) / q_range
    decoded = one.decode(coding, tuple(vectors.shape), torch.float32)
    assert torch.equal(decoded, (lattice * scale) @ one.reference.H)
    # The largest rotated coordinate lands on ±Q: the scale is that coordinate's fp16 value over Q.
    rotated = vectors @ one.reference.H
    largest = rotated.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).eps).half()
    assert torch.equal(torch.from_numpy(coding.qmax), largest)
    assert (torch.from_numpy(coding.doubled).abs().amax(dim=1)[:-4] >= 2 * q_range - 2).all()
    assert torch.equal(decoded[-4:], torch.zeros(4, 64))  # zero vectors stay zero
    # Dropping the norm loses nothing: the error is the two-scale codec's to within a percent.
    error_one = (decoded - vectors).norm() / vectors.norm()
    error_two = (two.decode(two.encode(vectors), tuple(vectors.shape), torch.float32) - vectors).norm() / vectors.norm()
    assert abs(float(error_one / error_two) - 1.0) < 0.01
    # A forward's block coding gives the same codes and values as `encode` and `decode`.
    keys, values = vectors[:1000].reshape(1, 2, 500, 64), vectors[1000:2000].reshape(1, 2, 500, 64)
    ((decoded_keys, decoded_values, staged),) = one.code_blocks([(keys, values)], torch.float32)
    assert torch.equal(torch.cat([decoded_keys, decoded_values]).reshape(-1, 64), decoded[:2000])
    assert torch.equal(staged.doubled.reshape(-1, 64), torch.from_numpy(coding.doubled[:2000]))


def test_one_scale_codes_keep_vectors_beyond_fp16s_range_finite():
    one = TorchLatticeCodec(LatticeSpec("d4", 64, 38, one_scale=True), torch.device("cpu"))
    vectors = _vectors(7, n=8) * 1e5  # rotated coordinates far above 65504
    decoded = one.decode(one.encode(vectors), tuple(vectors.shape), torch.float32)
    assert torch.isfinite(decoded).all()


def test_a_compressor_rejects_unknown_names_and_q_ranges_outside_its_lattice():
    with pytest.raises(ValueError, match="unknown KV compressor"):
        KVCompressor("kakeya_z8")
    with pytest.raises(ValueError, match="q_range"):
        KVCompressor("kakeya_e8", 117)
    with pytest.raises(ValueError, match="q_range"):
        KVCompressor("kakeya_d4", 0)
    assert KVCompressor("kakeya_d4", 152).spec(128).bits_per_vector == 1088  # the package's own figure
