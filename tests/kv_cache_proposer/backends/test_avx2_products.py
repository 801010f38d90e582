"""Linear layers' products in the compiled kernel's own arithmetic (`avx2_products.c`): the float head (a CPU
without int8 dot products) and int4 over quantized rows (a CPU with AVX2) give a row the same values among any rows
and threads, close to the values their codes stand for, the same on AVX512-VNNI dot products as on AVX2's byte
products, and a verifier's logits for a token are the same in a block and in single steps."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import pytest
import torch

from kv_cache_proposer.backends.torch_backend import products
from kv_cache_proposer.backends.torch_backend.kernel_build import EXACT_FLAGS, built
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.backends.torch_backend.weights import (
    DENSE_EXACT,
    INT4_QROWS,
    INT8_FLOAT,
    INT8_SPLIT,
    PackedLinear,
    held_values,
    int4_codes,
    integer_head_product,
    quantize_int4_qrows,
    quantize_int8,
)
from tests.support.backends import assert_steps_meet_the_block

pytestmark = pytest.mark.usefixtures("one_torch_thread", "fresh_product_kernel")


@pytest.fixture
def float_head(kernel) -> products.ProductKernel:
    if not torch.cpu.get_capabilities().get("avx2", False):
        pytest.skip("this CPU has no AVX2: an int8 head without int8 dot products holds its codes' float32 values")
    assert kernel.serves_float_head
    return kernel


@pytest.fixture
def int4_qrows(kernel) -> products.ProductKernel:
    if not kernel.serves_int4_qrows:
        pytest.skip(
            "int4 over quantized rows needs the kernel's AVX2 build (a CPU with AVX2 and FMA): this CPU's int4 layers "
            "take bfloat16 rows"
        )
    return kernel


def _float_head_layer(outputs: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    codes, scale = quantize_int8(torch.randn(outputs, width, generator=generator))
    codes[0] = 127  # the extreme codes
    codes[1] = -127
    return codes, scale.float()


def _test_rows(width: int, generator: torch.Generator) -> torch.Tensor:
    """70 rows of `width` inputs, each with an outlier input (5); row 4 all zeros."""
    x = torch.randn(70, width, generator=generator) * 3
    x[:, 5] *= 40
    x[4] = 0.0
    return x


def _assert_rows_alike(product: Callable[[torch.Tensor, int], torch.Tensor], x: torch.Tensor, whole: torch.Tensor):
    """`product(rows, threads)` gives every row of `x` its row of `whole`, whatever rows and threads share the call."""
    for start, count in ((0, 1), (3, 1), (3, 2), (5, 3), (9, 8), (20, 13), (0, 70)):
        for threads in (1, 2):
            rows = product(x[start : start + count], threads)
            assert torch.equal(rows, whole[start : start + count]), (start, count, threads)


@pytest.mark.parametrize(("outputs", "width"), [(8, 8), (301, 96), (1000, 576), (17, 8192)])
def test_the_float_head_gives_a_row_the_same_logits_among_any_rows_and_threads(float_head, outputs, width):
    codes, scale = _float_head_layer(outputs, width, width)
    x = _test_rows(width, torch.Generator().manual_seed(outputs))
    logits = float_head.float_head_product(x, codes, scale, 2)
    assert logits.dtype == torch.float32 and logits.shape == (70, outputs)
    _assert_rows_alike(lambda rows, threads: float_head.float_head_product(rows, codes, scale, threads), x, logits)
    assert torch.equal(logits[4], torch.zeros(outputs))
    exact = x.double() @ (codes.double() * scale.double()[:, None]).t()
    assert float((logits.double() - exact).abs().max()) < 1e-5 * float(exact.abs().max())
    assert torch.equal(torch.ops.kakeya.int8_float_head(x, codes, scale), logits)


def test_the_float_head_serves_widths_of_whole_vectors_and_refuses_the_rest(float_head):
    assert products.float_head_serves(576) and products.float_head_serves(products.FLOAT_HEAD_MAX_WIDTH)
    for width in (4, 100, products.FLOAT_HEAD_MAX_WIDTH + 8):
        assert not products.float_head_serves(width)
    codes, scale = _float_head_layer(16, 100, 0)
    with pytest.raises(ValueError, match="does not serve 2 rows of 100 values"):
        float_head.float_head_product(torch.zeros(2, 100), codes, scale, 1)
    codes, scale = _float_head_layer(16, 64, 0)
    with pytest.raises(ValueError, match="reads float32 rows"):
        float_head.float_head_product(torch.zeros(2, 64, dtype=torch.bfloat16), codes, scale, 1)
    source = torch.nn.Linear(100, 40, bias=False)  # a width it does not serve: the float32 values of the codes
    assert PackedLinear(source, "int8", wide=True).kind in (INT8_SPLIT, DENSE_EXACT)


def _assert_steps_meet_the_block(verifier: TorchVerifier) -> None:
    """The last 7 tokens of a 12-token block get the same logits in decode steps after a 5-token prefill."""
    assert_steps_meet_the_block(verifier, list(range(3, 15)), 5)


def test_an_int4_verifier_multiplies_its_head_on_the_float_kernel_with_the_same_logits_for_any_block(
    checkpoints, float_head
):
    if integer_head_product():
        pytest.skip("this CPU has int8 dot products: an int8 head multiplies its inputs as integers")
    verifier = TorchVerifier.load(checkpoints["llama"], device="cpu", dtype="float32", weights="int4")
    head = verifier.model.get_output_embeddings()
    assert isinstance(head, PackedLinear) and head.kind == INT8_FLOAT and head.weight.dtype == torch.int8
    _assert_steps_meet_the_block(verifier)


def _qrows_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """int4 over quantized rows in float64: each row's groups of 32 inputs as their magnitudes over the group's step
    (its largest magnitude / 255) rounded to integers, with their signs; their exact sums with code - 8 times scale ×
    step, plus each zero point times its group's input sum; `weight` [N, K] held as `int4_codes` gives it."""
    codes, scale, zero = int4_codes(weight)
    outputs, width = codes.shape
    groups = x.reshape(x.shape[0], width // 32, 32)  # [M, G, 32]
    step = groups.abs().amax(dim=-1) / 255  # float32, as the kernel divides
    magnitudes = torch.where(step[..., None] > 0, torch.round(groups.abs() / step[..., None]), torch.zeros(()))
    q = torch.where(groups < 0, -magnitudes, magnitudes)
    centred = (codes - 8).reshape(outputs, width // 32, 32).double()
    sums = torch.einsum("mgk,ngk->mng", q.double(), centred)  # exact: small integers
    scale, zero = scale.to(torch.bfloat16).double(), zero.to(torch.bfloat16).double()  # [N, G], as held
    coded = (sums * scale[None] * step.double()[:, None, :]).sum(dim=-1)
    return coded + (zero[None] * groups.double().sum(dim=-1)[:, None, :]).sum(dim=-1)


@pytest.mark.parametrize(("outputs", "inputs"), [(8, 32), (40, 96), (960, 576), (576, 1536)])
def test_int4_over_quantized_rows_gives_a_row_the_same_values_among_any_rows_and_threads(int4_qrows, outputs, inputs):
    generator = torch.Generator().manual_seed(outputs)
    weight = torch.randn(outputs, inputs, generator=generator) * 0.05
    weight[0, :32] = 0.0  # a group of equal weights
    codes, qparams = quantize_int4_qrows(weight)
    assert codes.dtype == torch.uint8 and codes.shape == (outputs // 8, 4 * inputs)
    x = _test_rows(inputs, generator)
    x[6, :32] = 0.0  # a group of zeros
    values = int4_qrows.int4_qrows_product(x, codes, qparams, 2)
    assert values.dtype == torch.float32 and values.shape == (70, outputs)
    _assert_rows_alike(lambda rows, threads: int4_qrows.int4_qrows_product(rows, codes, qparams, threads), x, values)
    assert torch.equal(values[4], torch.zeros(outputs))
    expected = _qrows_reference(x, weight)
    assert float((values.double() - expected).abs().max()) < 1e-5 * float(expected.abs().max())
    held = x.double() @ held_values(weight, "int4").double().t()  # what the codes stand for, at float64 inputs
    # the rounding of the inputs, coarser in the groups that hold the outlier
    assert float((values.double() - held).norm() / held.norm()) < 0.02
    assert torch.equal(torch.ops.kakeya.int4_qrows(x, codes, qparams), values)


def test_int4_over_quantized_rows_by_vnni_dot_products_gives_the_byte_products_values(int4_qrows):
    if not torch.cpu.get_capabilities().get("avx512_vnni", False):
        pytest.skip("this CPU has no AVX512-VNNI: its build multiplies with AVX2's byte products alone")
    bytewise = ctypes.CDLL(str(built(products.AVX2_SOURCES, (*EXACT_FLAGS, "-mno-avx512f"))))
    multiply = bytewise.int4_qrows
    p, i = ctypes.c_void_p, ctypes.c_int
    multiply.argtypes, multiply.restype = [p, i, p, ctypes.c_float, p, p, p, ctypes.c_int64, i, i], i
    generator = torch.Generator().manual_seed(3)
    for outputs, inputs in [(8, 32), (40, 96), (576, 576), (1536, 576), (576, 1536)]:
        codes, qparams = quantize_int4_qrows(torch.randn(outputs, inputs, generator=generator))
        norm = torch.rand(inputs, generator=generator) + 0.5
        for rows in (1, 2, 3, 5, 9):
            x = _test_rows(inputs, generator)[:rows].contiguous()
            for weight in (None, norm):
                expected = torch.empty(rows, outputs)
                pointer = None if weight is None else weight.data_ptr()
                status = multiply(x.data_ptr(), rows, pointer, 1e-5, codes.data_ptr(), qparams.data_ptr(),
                                  expected.data_ptr(), outputs, inputs, 2)  # fmt: skip
                assert status == 0
                values = int4_qrows.int4_qrows_product(x, codes, qparams, 2, weight, 1e-5)
                assert torch.equal(values, expected), (outputs, inputs, rows, weight is None)


@pytest.mark.parametrize(("outputs", "inputs"), [(40, 96), (960, 576)])
def test_int4_over_quantized_rows_under_the_rms_norm_normalises_each_row_on_its_own(int4_qrows, outputs, inputs):
    generator = torch.Generator().manual_seed(inputs)
    weight = torch.randn(outputs, inputs, generator=generator) * 0.05
    codes, qparams = quantize_int4_qrows(weight)
    norm, eps = torch.rand(inputs, generator=generator) + 0.5, 1e-5
    x = _test_rows(inputs, generator)
    values = int4_qrows.int4_qrows_product(x, codes, qparams, 2, norm, eps)
    assert values.dtype == torch.float32 and values.shape == (70, outputs)
    _assert_rows_alike(
        lambda rows, threads: int4_qrows.int4_qrows_product(rows, codes, qparams, threads, norm, eps), x, values
    )
    assert torch.equal(values[4], torch.zeros(outputs))  # a row of zeros stays zeros
    normed = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps) * norm.double()
    # the float32 norm rounds a few inputs across a step of their group's quantization
    expected = _qrows_reference(normed.float(), weight)
    assert float((values.double() - expected).norm() / expected.norm()) < 1e-4
    unnormed = int4_qrows.int4_qrows_product(x, codes, qparams, 2)
    assert not torch.equal(values, unnormed)
    assert torch.equal(torch.ops.kakeya.int4_qrows(x, codes, qparams, norm, eps), values)
    with pytest.raises(ValueError, match=f"is float32 \\[{inputs}\\]"):
        int4_qrows.int4_qrows_product(x, codes, qparams, 1, norm[:-1], eps)
    with pytest.raises(ValueError, match=f"is float32 \\[{inputs}\\]"):
        int4_qrows.int4_qrows_product(x, codes, qparams, 1, norm.double(), eps)


def test_int4_over_quantized_rows_serves_whole_tiles_and_groups_and_refuses_the_rest(int4_qrows):
    assert products.int4_qrows_serves(576, 1536) and products.int4_qrows_serves(8, 32)
    for outputs, width in ((12, 96), (4, 96), (16, 48), (16, 0)):
        assert not products.int4_qrows_serves(outputs, width)
    codes, qparams = quantize_int4_qrows(torch.randn(16, 64))
    with pytest.raises(ValueError, match="do not take rows of 96 inputs"):
        int4_qrows.int4_qrows_product(torch.zeros(2, 96), codes, qparams, 1)
    with pytest.raises(ValueError, match="reads float32 rows"):
        int4_qrows.int4_qrows_product(torch.zeros(2, 64, dtype=torch.bfloat16), codes, qparams, 1)
    layer = PackedLinear(torch.nn.Linear(96, 16, bias=True), "int4")
    assert layer.kind == INT4_QROWS
    x = torch.randn(3, 96)
    assert torch.equal(layer(x), int4_qrows.int4_qrows_product(x, layer.weight, layer.qparams, 1) + layer.bias)


def test_an_int4_verifier_holds_its_block_layers_for_quantized_rows_with_the_same_logits_for_any_block(
    checkpoints, int4_qrows
):
    verifier = TorchVerifier.load(checkpoints["llama"], device="cpu", dtype="float32", weights="int4")
    head = verifier.model.get_output_embeddings()
    blocks = [m for m in verifier.model.modules() if isinstance(m, PackedLinear) and m is not head]
    assert blocks and all(m.kind == INT4_QROWS for m in blocks)
    direct = verifier._direct
    assert direct is not None
    for layer in direct._layers:  # Q/K/V and gate/up stacked, the kernel computing the norm before each
        assert len(layer.inputs[2]) == 1 and len(layer.output[3]) == 1
    _assert_steps_meet_the_block(verifier)
