"""The reference K/V formats of scripts/lib/kv_formats.py against their published definitions, and the attention
that scripts/bench_kv_quality.py reads them through against the daemon's own compressed cache."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kv_cache_proposer.backends.torch_backend.lattice_codec import TorchLatticeCodec
from kv_cache_proposer.compression import KVCompressor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from lib.kv_formats import affine, fp8_e4m3, hadamard, kv_format, q4_0, q8_0, rotated  # noqa: E402


def _vectors(seed: int, count: int = 200, dim: int = 64) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((count, dim)) * rng.uniform(0.01, 20.0, (count, 1))
    x[0, :32] = 0.0  # an all-zero block
    x[1, 5] = 40.0  # an outlier
    return torch.from_numpy(x.astype(np.float32))


def test_q8_0_rounds_each_block_of_32_by_its_largest_magnitude_over_127():
    block = torch.zeros(1, 32)
    block[0, :4] = torch.tensor([1.27, -0.5, 0.005, 0.015])  # d = 0.01: codes 127, -50, 0.5 -> 1 (away), 1.5 -> 2
    read, bits = q8_0(block)
    d = float(torch.tensor(0.01).to(torch.float16))  # the scale is held in fp16
    assert read[0, :4].tolist() == pytest.approx([127 * d, -50 * d, 1 * d, 2 * d], abs=1e-7)
    assert bits == 8.5


def test_q4_0_scales_by_the_signed_largest_value_over_minus_8_and_truncates():
    block = torch.zeros(1, 32)
    block[0, :4] = torch.tensor([-4.0, 1.25, 3.9, -0.3])  # d = 0.5: 0.5, 11.0, 16.3, 7.9 truncated, clamped to 15
    read, bits = q4_0(block)
    assert read[0, :4].tolist() == [-4.0, 1.5, 3.5, -0.5]
    assert read[0, 4:].tolist() == [0.0] * 28  # 0 / d + 8.5 -> 8 -> 0
    assert bits == 4.5


@pytest.mark.parametrize(("ours", "qtype"), [(q8_0, GGMLQuantizationType.Q8_0), (q4_0, GGMLQuantizationType.Q4_0)])
def test_the_ggml_formats_read_back_what_ggmls_reference_quantizer_writes(ours, qtype):
    x = _vectors(0)
    reference = quants.dequantize(quants.quantize(x.numpy(), qtype), qtype)
    assert np.array_equal(ours(x)[0].numpy(), reference)


def test_the_rotation_is_orthonormal_and_spreads_an_outlier_that_q4_0_would_crush():
    h = hadamard(64)
    assert torch.allclose(h @ h, torch.eye(64), atol=1e-6)
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((100, 64)).astype(np.float32))
    x[:, 3] = 30.0  # an outlier channel: unrotated, it sets every first block's scale and crushes the rest
    plain, rot = q4_0(x)[0], rotated(q4_0)(x)[0]
    assert ((rot - x) ** 2).sum() < ((plain - x) ** 2).sum() / 2
    assert rotated(q8_0)(x)[1] == 8.5


def test_fp8_e4m3_keeps_representable_values_rounds_to_nearest_and_saturates():
    x = torch.tensor([[1.0, 0.5, 448.0, 0.3, 1000.0, -1000.0, 0.0, -2.25]])
    read, bits = fp8_e4m3(x)
    assert read[0].tolist() == [1.0, 0.5, 448.0, 0.3125, 448.0, -448.0, 0.0, -2.25]
    assert bits == 8.0


@pytest.mark.parametrize("bits", [4, 8])
def test_the_affine_format_is_mlxs_quantize_and_dequantize(bits):
    import mlx.core as mx

    x = _vectors(1)
    packed, scales, biases = mx.quantize(mx.array(x.numpy()), group_size=64, bits=bits)
    reference = np.array(mx.dequantize(packed, scales, biases, group_size=64, bits=bits))
    read, held = affine(bits, stored=torch.float32)(x)
    assert np.array_equal(read.numpy(), reference)
    assert held == bits + 1.0  # a float32 scale and bias per 64 values
    assert affine(bits)(x)[1] == bits + 0.5  # in a 16-bit model dtype


def test_a_lattice_format_is_the_packages_roundtrip_with_the_bits_the_store_holds():
    from kakeyalattice import V14KakeyaZamirLatticeGPU

    x = _vectors(2)
    read, bits = kv_format("kakeya_d4:38").roundtrip(x)
    reference = V14KakeyaZamirLatticeGPU(D=64, q_range=38, device="cpu").roundtrip(x)
    assert torch.equal(read, reference)
    assert bits >= 6.75  # 432 bits per 64 values, plus 32 bytes per escaped block
    assert kv_format("kakeya_d4:10").roundtrip(x)[1] < bits


def test_a_one_scale_lattice_format_reads_back_the_daemons_coding_at_a_quarter_bit_less():
    x = _vectors(3)
    read, bits = kv_format("kakeya_d4s:10").roundtrip(x)
    codec = TorchLatticeCodec(KVCompressor("kakeya_d4s", 10).spec(64), torch.device("cpu"))
    assert torch.equal(read, codec.decode(codec.encode(x.reshape(-1, 64)), tuple(x.shape), torch.float32))
    two_scale_bits = kv_format("kakeya_d4:10").roundtrip(x)[1]
    assert two_scale_bits - bits == pytest.approx(0.25)  # 16 bits per 64 values (no escapes at D4, Q=10 here)
    assert bits == pytest.approx(4.5)


@pytest.mark.parametrize("name", ["kakeya_d4", "q4_0:3", "int3", "kakeya_e8:x"])
def test_a_bad_format_name_is_refused(name):
    with pytest.raises(ValueError):
        kv_format(name)


@pytest.fixture(scope="module")
def format_model(checkpoints):
    from bench_kv_quality import ATTENTION, FormatAttention
    from transformers import AttentionInterface, AutoModelForCausalLM

    attention = FormatAttention()
    AttentionInterface.register(ATTENTION, attention)
    model = AutoModelForCausalLM.from_pretrained(
        str(checkpoints["llama"]), local_files_only=True, dtype=torch.float32, attn_implementation=ATTENTION
    ).eval()
    return attention, model


def _window(length: int) -> list[int]:
    rng = np.random.default_rng(3)
    return [int(t) for t in rng.integers(0, 128, length)]


def test_through_the_none_format_attention_is_the_models_own(format_model, checkpoints):
    from bench_kv_quality import greedy, log_probs
    from transformers import AutoModelForCausalLM

    attention, model = format_model
    plain = AutoModelForCausalLM.from_pretrained(str(checkpoints["llama"]), local_files_only=True, dtype=torch.float32)
    window = _window(300)
    attention.use(kv_format("none"))
    ours = log_probs(model, window)
    reference = torch.log_softmax(plain(torch.tensor([window])).logits[0, :-1].float(), -1)
    assert torch.allclose(ours, reference, atol=1e-4)
    attention.use(kv_format("none"))
    assert greedy(model, window[:100], 12) == greedy(plain, window[:100], 12)


def test_a_lattice_format_reads_what_a_compressed_session_of_the_daemon_reads(format_model, checkpoints):
    """The bench's perplexity is the compressed cache's: the same next-token distribution as a `kakeya_d4:38`
    session's verifier over the same block, within float rounding."""
    from bench_kv_quality import log_probs

    from kv_cache_proposer.backends import load_verifier
    from kv_cache_proposer.compression import compressor_layer_store
    from kv_cache_proposer.strategies import FullStrategy

    attention, model = format_model
    window = _window(300)
    attention.use(kv_format("kakeya_d4:38"))
    ours = log_probs(model, window)
    verifier = load_verifier("torch", checkpoints["llama"], device="cpu", dtype="float32")
    cache = verifier.new_cache(
        FullStrategy(), layer_store=compressor_layer_store("torch", KVCompressor("kakeya_d4", 38))
    )
    logits = verifier.verify(cache, window, len(window)).logits[:-1]
    daemon = torch.log_softmax(torch.as_tensor(logits).float(), -1)
    assert torch.allclose(ours, daemon, atol=2e-3)
    attention.use(kv_format("none"))
    dense = log_probs(model, window)
    assert not torch.allclose(dense, daemon, atol=2e-3)  # the codec's rounding is what the comparison sees
