"""Linear layers held as bfloat16, int8 or int4: the kernels compute with exactly the weights they hold, those
weights stay close to float32, both forwards agree, and a GGUF Q4_1 block is held at its own codes."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from inference_engine.model_source import resolve_model
from kv_cache_proposer.backends.torch_backend import direct as direct_module
from kv_cache_proposer.backends.torch_backend import exact_attention
from kv_cache_proposer.backends.torch_backend import weights as weights_module
from kv_cache_proposer.backends.torch_backend.products import int4_qrows_serves
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.backends.torch_backend.weights import (
    DENSE_EXACT,
    INT4,
    INT4_QROWS,
    INT8,
    INT8_FLOAT,
    INT8_SPLIT,
    PackedLinear,
    held_values,
    int4_codes,
    int4_values,
    integer_head_product,
    linear,
    pack_linears,
    quantize_int8,
    stack_int4,
)
from kv_cache_proposer.errors import ModelLoadError
from kv_cache_proposer.proposers import ProposerOptions
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy
from tests.support.decoding import decode
from tests.support.gguf_files import write_gguf

PROMPT = list(range(3, 40))
ARCHS = ("llama", "qwen3")
# Largest logit error against float32, relative to the largest logit, on the tiny random test models, and the
# share of positions whose greedy pick stays float32's: bfloat16 and int8 barely move them, int4 (16 levels per
# group of 32 random weights, none of the outliers a trained model's int4 groups absorb) moves them most. The
# default model's quality per choice is measured by scripts/eval_weights.py (docs/models.md#weights).
TOLERANCES = {"bfloat16": (0.03, 0.95), "int8": (0.08, 0.95), "int4": (0.6, 0.5)}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def greedy_tokens(verifier: TorchVerifier) -> list[int]:
    """24 greedy tokens through the verifier's own forwards (prefill, then one step at a time)."""
    return decode(verifier, "torch", FullStrategy(), ProposerOptions(name="none"), SamplingParams())


def _logits(verifier: TorchVerifier) -> torch.Tensor:
    with torch.inference_mode():
        return verifier.model(torch.tensor([PROMPT])).logits[0].float()  # [T, V]


def _relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return float((logits - reference).abs().max() / reference.abs().max())


def _held_copy(checkpoint: Path, weights: str, directory: Path) -> Path:
    """`checkpoint` with every linear layer's weight replaced by the float32 values a `PackedLinear` holds."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (checkpoint / name).exists():
            (directory / name).write_bytes((checkpoint / name).read_bytes())
    tensors = load_file(str(checkpoint / "model.safetensors"))
    linears = {name for name, t in tensors.items() if t.ndim == 2 and "embed_tokens" not in name}
    head_weights = "int8" if weights == "int4" else weights  # a 4-bit model's head is held at 8 bits
    held = {name: held_values(t, weights) if name in linears else t for name, t in tensors.items()}
    if "lm_head.weight" in held:
        held["lm_head.weight"] = held_values(tensors["lm_head.weight"], head_weights)
    else:  # tied: the head gets its own packed copy, the embedding stays float32
        held["lm_head.weight"] = held_values(tensors["model.embed_tokens.weight"], head_weights)
        config = (
            (directory / "config.json")
            .read_text()
            .replace('"tie_word_embeddings": true', '"tie_word_embeddings": false')
        )
        (directory / "config.json").write_text(config)
    save_file(held, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("weights", ["bfloat16", "int8", "int4"])
def test_packed_weights_compute_with_exactly_the_values_they_hold(checkpoints, tmp_path, arch, weights):
    packed = TorchVerifier.load(checkpoints[arch], device="cpu", dtype="float32", weights=weights)
    assert packed.weights == weights and f"weights: {weights}" in packed.description
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules())
    held = TorchVerifier.load(_held_copy(checkpoints[arch], weights, tmp_path / "held"), device="cpu", dtype="float32")
    # what is left is the rounding of the kernels' inputs and outputs: bfloat16, or 9-bit integers per group of 32
    # inputs where int4 layers multiply quantized rows
    quantized = any(isinstance(m, PackedLinear) and m.kind == INT4_QROWS for m in packed.model.modules())
    logits, reference = _logits(packed), _logits(held)
    assert _relative_error(logits, reference) < (0.04 if quantized else 0.02)
    assert float((logits.argmax(-1) == reference.argmax(-1)).float().mean()) >= 0.9


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("weights", ["bfloat16", "int8", "int4"])
def test_each_choice_stays_within_its_tolerance_of_float32(checkpoints, arch, weights):
    reference = _logits(TorchVerifier.load(checkpoints[arch], device="cpu", dtype="float32"))
    logits = _logits(TorchVerifier.load(checkpoints[arch], device="cpu", dtype="float32", weights=weights))
    error_bound, agreement_floor = TOLERANCES[weights]
    assert _relative_error(logits, reference) < error_bound
    assert float((logits.argmax(-1) == reference.argmax(-1)).float().mean()) >= agreement_floor


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_direct_forward_and_transformers_modules_agree_on_packed_weights(checkpoints, weights, monkeypatch):
    # Both attend with PyTorch's flash kernel, so that the products of the weights are what is compared: the compiled
    # kernel's last bits, magnified by the bfloat16 inputs of the packed products, flip near-ties of this random model.
    monkeypatch.setattr(exact_attention, "dense_kernel", lambda: None)
    direct = TorchVerifier.load(checkpoints["qwen3"], device="cpu", dtype="float32", weights=weights, kv_dtype="model")
    library = TorchVerifier.load(
        checkpoints["qwen3"], device="cpu", dtype="float32", weights=weights, forward="library"
    )
    assert direct.forward_path == "direct" and library.forward_path.startswith("transformers modules")
    assert greedy_tokens(direct) == greedy_tokens(library)


def test_a_q4_1_block_is_held_at_its_own_codes_scale_and_offset():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((16, 128)).astype(np.float32)
    blocks = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_1)
    stored = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1).copy())  # [16, 128]
    codes, scale, zero = int4_codes(stored)
    # with float32 scale and offset the codes give back every stored value: nothing was quantized again
    torch.testing.assert_close(int4_values(codes, scale, zero), stored, rtol=0, atol=1e-5)
    # the kernel holds scale and offset in bfloat16: the only rounding a Q4_1 file's weights meet
    held = int4_values(codes, scale.to(torch.bfloat16), zero.to(torch.bfloat16))
    step = scale.repeat_interleave(32, dim=1)
    assert float(((held - stored).abs() / step).max()) < 0.1  # within a tenth of a quantization step


def test_int4_holds_the_lm_head_at_int8(checkpoints):
    model = TorchVerifier.load(checkpoints["llama"], device="cpu", dtype="float32", weights="int4").model
    head = model.get_output_embeddings()
    assert isinstance(head, PackedLinear) and head.kind in (INT8_SPLIT, INT8_FLOAT, DENSE_EXACT)
    assert (head.kind == INT8_SPLIT) == integer_head_product()
    block = model.model.layers[0].mlp.down_proj
    assert isinstance(block, PackedLinear) and block.kind in (INT4, INT4_QROWS)
    assert (block.kind == INT4_QROWS) == int4_qrows_serves(block.out_features, block.in_features)


def test_the_split_int8_product_gives_a_row_the_same_values_among_any_rows_and_meets_its_codes_exactly():
    generator = torch.Generator().manual_seed(0)
    codes, scale = quantize_int8(torch.randn(300, 96, generator=generator))
    x = torch.randn(40, 96, generator=generator)
    x[:, 7] *= 40  # an outlier input, as a trained model's hidden states have
    x[5] = 0.0  # a row of zeros
    held = codes.float() * scale.float()[:, None]  # [out, in]: what the codes stand for
    split = linear(x, codes, None, scale.float(), INT8_SPLIT, 0)  # [40, 300]
    for start, count in ((0, 1), (3, 2), (5, 5), (11, 9), (2, 1), (0, 40)):
        rows = linear(x[start : start + count], codes, None, scale.float(), INT8_SPLIT, 0)
        assert torch.equal(rows, split[start : start + count]), (start, count)
    assert torch.equal(split[5], torch.zeros(300))
    exact = x.double() @ held.double().t()
    # the inputs meet the codes within 2^-14 of each row's largest input; the packed kernel rounds them to bfloat16
    packed = linear(x, codes, None, scale, INT8, 0)
    split_error = float((split.double() - exact).abs().max())
    assert split_error < 2e-3 * float(exact.abs().max())
    assert split_error * 10 < float((packed.double() - exact).abs().max())


@pytest.mark.parametrize(
    ("integer", "float_kernel", "kind"),
    [(True, True, INT8_SPLIT), (False, True, INT8_FLOAT), (False, False, DENSE_EXACT)],
    ids=["int8-dot-products", "float-kernel", "none"],
)
def test_an_int8_head_holds_its_codes_and_gives_a_row_the_same_logits_among_any_rows_on_every_cpu(
    monkeypatch, integer, float_kernel, kind
):
    if float_kernel and not integer and not weights_module.float_head_serves(96):
        pytest.skip("no C compiler or no AVX2 here: the product kernel's float head is not built")
    monkeypatch.setattr(weights_module, "integer_head_product", lambda: integer)
    monkeypatch.setattr(weights_module, "float_head_serves", lambda width: float_kernel)
    generator = torch.Generator().manual_seed(1)
    source = torch.nn.Linear(96, 300, bias=False)
    with torch.no_grad():
        source.weight.copy_(torch.randn(300, 96, generator=generator))
    head = PackedLinear(source, "int8", wide=True)
    assert head.kind == kind
    assert head.weight.dtype == (torch.float32 if kind == DENSE_EXACT else torch.int8)  # the codes' bytes held
    x = torch.randn(40, 96, generator=generator)
    x[:, 7] *= 40  # an outlier input
    logits = head(x)
    for start, count in ((0, 1), (3, 2), (5, 5), (11, 9), (0, 40)):
        assert torch.equal(head(x[start : start + count]), logits[start : start + count]), (start, count)
    exact = x.double() @ held_values(source.weight, "int8").double().t()
    assert float((logits.double() - exact).abs().max()) < 2e-3 * float(exact.abs().max())


def test_int8_and_int4_refuse_a_device_their_kernels_do_not_run_on():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32)).to("meta")
    with pytest.raises(ModelLoadError, match="runs on a CPU"):
        pack_linears(model, "int4")


def test_int4_refuses_a_layer_whose_inputs_do_not_fill_groups_of_32():
    with pytest.raises(ModelLoadError, match="groups of 32"):
        pack_linears(torch.nn.Sequential(torch.nn.Linear(48, 32)), "int4")


def test_a_q4_1_gguf_at_int4_gives_its_dequantized_logits_within_rounding(checkpoints, tmp_path):
    gguf_file = write_gguf(checkpoints["llama"], tmp_path / "llama-q4_1.gguf", "Q4_1")
    directory = resolve_model(str(gguf_file), tmp_path / "cache").directory  # the file's weights, dequantized
    dequantized = _logits(TorchVerifier.load(directory, device="cpu", dtype="float32"))
    held = TorchVerifier.load(directory, device="cpu", dtype="float32", weights="int4")
    blocks = [m for m in held.model.modules() if isinstance(m, PackedLinear) and m.kind in (INT4, INT4_QROWS)]
    assert blocks, "the block layers are held at int4"
    # the layers' codes are the file's own; what is left is bfloat16 rounding (inputs, block scales and offsets)
    # and the LM head's int8
    assert _relative_error(_logits(held), dequantized) < 0.02  # measured 0.0075 (int4 of a float checkpoint: 0.16)


def _int4_layer(outputs: int, seed: int, *, bias: bool = False, weights: str = "int4") -> PackedLinear:
    generator = torch.Generator().manual_seed(seed)
    source = torch.nn.Linear(96, outputs, bias=bias)
    with torch.no_grad():
        source.weight.copy_(torch.randn(outputs, 96, generator=generator))
        if bias:
            source.bias.copy_(torch.randn(outputs, generator=generator))
    return PackedLinear(source, weights)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_stacked_int4_layers_give_every_output_its_own_values_from_one_copy_of_the_codes(bias):
    layers = [_int4_layer(128, 1, bias=bias), _int4_layer(64, 2, bias=bias), _int4_layer(64, 3, bias=bias)]
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(4))
    alone = [layer(x) for layer in layers]
    stacked = stack_int4(list(layers))
    assert stacked is not None
    for count in (1, 3, 7, 40):
        split = linear(x[:count], *stacked).split([128, 64, 64], dim=-1)
        for own, part in zip(alone, split, strict=True):
            assert torch.equal(part, own[:count]), count
    weight = stacked[0]
    for layer, own in zip(layers, alone, strict=True):  # each layer reads its rows of the stack, as before
        assert weight.data_ptr() <= layer.weight.data_ptr() < weight.data_ptr() + weight.numel()
        assert torch.equal(layer(x), own)


def test_layers_whose_outputs_would_meet_other_arithmetic_are_not_stacked():
    first, second = _int4_layer(128, 1), _int4_layer(48, 2)
    if second.kind == INT4:  # 48 outputs: not whole blocks of PyTorch's int4 kernel (64 or 32 outputs)
        assert stack_int4([first, second]) is None
    else:  # int4 over quantized rows computes tiles of 8 outputs alike: 48 outputs stack
        assert second.kind == INT4_QROWS and stack_int4([first, second]) is not None
    assert stack_int4([_int4_layer(128, 1), _int4_layer(64, 2, bias=True)]) is None
    assert stack_int4([_int4_layer(128, 1), _int4_layer(64, 2, weights="int8")]) is None
    assert stack_int4([_int4_layer(128, 1)]) is None


def test_a_verifier_s_logits_do_not_depend_on_stacking(checkpoints, monkeypatch):
    def logits(stacks: int) -> list[torch.Tensor]:
        verifier = TorchVerifier.load(checkpoints["llama"], device="cpu", dtype="float32", weights="int4")
        assert verifier._direct is not None
        assert len(verifier._direct._layers[0].output[3]) == 2 - stacks  # gate and up: one product, or two
        cache = verifier.new_cache(FullStrategy())
        out = []
        for block in (PROMPT, [10], [11, 12, 13]):
            out.append(verifier.verify(cache, block, len(block)).logits.clone())
            verifier.commit(cache, len(block))
        return out

    stacked = logits(1)  # the tiny llama's gate and up (128 outputs each) are stacked
    monkeypatch.setattr(direct_module, "stack_int4", lambda modules: None)
    for with_stack, without in zip(stacked, logits(0), strict=True):
        assert torch.equal(with_stack, without)
