"""Linear layers' products on the compiled kernel: the int8 head's integer sums are `_int_mm`'s for every width, row
count and value, and int4 rows are `_weight_int4pack_mm_for_cpu`'s bit for bit for every row count and layer
shape, so a token's logits are the same whichever computes them, through the verifier's forwards too; the float
head (a CPU without int8 dot products) and int4 over quantized rows (a CPU without AVX-512) give a row the same
values among any rows and threads, close to the values their codes stand for; turned off or failing to build,
PyTorch's kernels compute every product."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kv_cache_proposer.backends.torch_backend import products
from kv_cache_proposer.backends.torch_backend import weights as weights_module
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
from kv_cache_proposer.strategies import FullStrategy
from tests.support.compilers import use_broken_compiler

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def kernel() -> products.ProductKernel:
    products.product_kernel.cache_clear()
    loaded = products.product_kernel()
    if loaded is None:
        pytest.skip("no C compiler, or neither AVX512-VNNI nor AVX-512 on this CPU: PyTorch's kernels run")
    return loaded


@pytest.fixture
def int8_kernel(kernel) -> products.ProductKernel:
    if not torch.cpu.get_capabilities().get("avx512_vnni", False):
        pytest.skip("this CPU has no AVX512-VNNI: the int8 head's sums run on _int_mm")
    assert kernel.serves_int8
    return kernel


@pytest.fixture
def int4_kernel(kernel) -> products.ProductKernel:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        pytest.skip(
            f"PyTorch runs its {capability} int4 kernel here; the kernel's int4 blocks stand in for its AVX-512 one "
            "(a CPU with AVX2 only multiplies int4 layers by quantized rows, tested below)"
        )
    assert kernel.serves_int4, "the kernel's int4 rows differ from PyTorch's (its self-check at load failed)"
    assert kernel.int4_block == 64
    return kernel


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
            "int4 over quantized rows is the kernel's AVX2 build's (a CPU with AVX2, without AVX-512): this CPU's int4 "
            "layers take bfloat16 rows"
        )
    return kernel


@pytest.fixture(autouse=True)
def _fresh_kernel():
    products.product_kernel.cache_clear()
    yield
    products.product_kernel.cache_clear()


def _codes(outputs: int, width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (outputs, width), generator=generator, dtype=torch.int8)
    codes[0] = 127  # the largest sums the codes allow
    codes[1] = -127
    return codes


@pytest.mark.parametrize("width", [8, 63, 64, 96, 130, 576])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 8, 13])
def test_the_int8_sums_are_int_mm_s_for_every_width_and_row_count(int8_kernel, width, rows):
    codes = _codes(301, width, width)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randint(-127, 128, (rows, width), generator=generator, dtype=torch.int8)
    x[0] = 127
    x[-1] = -127
    sums = int8_kernel.sums(x, codes, products.code_offsets(codes), 2)
    assert sums.dtype == torch.int32 and sums.shape == (rows, 301)
    assert torch.equal(sums, torch._int_mm(x, codes.t()))


def test_the_int8_sums_read_code_rows_in_place_from_a_wider_matrix(int8_kernel):
    wide = _codes(200, 160, 3)
    codes = wide[:, :96]  # rows 160 apart
    x = torch.randint(-127, 128, (2, 96), dtype=torch.int8)
    assert torch.equal(int8_kernel.sums(x, codes, products.code_offsets(codes), 1), torch._int_mm(x, codes.t()))


def test_the_int8_sums_refuse_what_they_do_not_serve(int8_kernel):
    codes = _codes(10, 64, 0)
    with pytest.raises(ValueError, match="does not serve 65 rows"):
        int8_kernel.sums(torch.zeros(65, 64, dtype=torch.int8), codes, products.code_offsets(codes), 1)
    with pytest.raises(ValueError, match="as long as the input rows"):
        int8_kernel.sums(torch.zeros(2, 32, dtype=torch.int8), codes, products.code_offsets(codes), 1)


def test_row_sums_run_few_rows_on_the_kernel_and_more_on_int_mm(int8_kernel, monkeypatch):
    calls: list[int] = []

    class Counting:
        serves_int8 = True

        def sums(self, rows, codes, offsets, threads):
            calls.append(int(rows.shape[0]))
            return int8_kernel.sums(rows, codes, offsets, threads)

    monkeypatch.setattr(products, "product_kernel", lambda: Counting())
    codes = _codes(50, 64, 1)
    offsets = products.code_offsets(codes)
    for count in (1, products.MAX_INT8_ROWS, products.MAX_INT8_ROWS + 1):
        x = torch.randint(-127, 128, (count, 64), dtype=torch.int8)
        assert torch.equal(products.row_sums(x, codes, offsets), torch._int_mm(x, codes.t()))
    assert torch.equal(products.row_sums(x, codes, None), torch._int_mm(x, codes.t()))
    assert calls == [1, products.MAX_INT8_ROWS]


def test_an_int8_head_gives_the_same_logits_on_the_kernel_as_on_int_mm(int8_kernel, monkeypatch):
    if not integer_head_product():
        pytest.skip("this CPU has no int8 dot products: an int8 head multiplies its codes in float32, not as integers")
    generator = torch.Generator().manual_seed(2)
    source = torch.nn.Linear(96, 300, bias=True)
    with torch.no_grad():
        source.weight.copy_(torch.randn(300, 96, generator=generator))
    head = PackedLinear(source, "int8", wide=True)
    assert head.kind == INT8_SPLIT
    x = torch.randn(2, 5, 96, generator=generator)
    x[..., 7] *= 40  # an outlier input
    on_kernel = [head(x[:, :count]) for count in (1, 2, 3, 5)]
    monkeypatch.setenv(products.ENV, "off")
    products.product_kernel.cache_clear()
    assert products.product_kernel() is None
    for count, logits in zip((1, 2, 3, 5), on_kernel, strict=True):
        assert torch.equal(head(x[:, :count]), logits), count


def test_a_verifier_s_logits_do_not_depend_on_the_kernel(checkpoints, kernel, monkeypatch):
    if not integer_head_product():
        pytest.skip("this CPU has no int8 dot products: an int8 head multiplies its codes in float32, not as integers")

    def logits() -> list[torch.Tensor]:
        verifier = TorchVerifier.load(checkpoints["llama"], device="cpu", dtype="float32", weights="int4")
        cache = verifier.new_cache(FullStrategy())
        out = []
        for block in ([3, 4, 5, 6, 7, 8, 9], [10], [11, 12], [13]):  # a prefill, decode steps, a short block
            out.append(verifier.verify(cache, block, len(block)).logits.clone())
            verifier.commit(cache, len(block))
        return out

    with_kernel = logits()
    monkeypatch.setenv(products.ENV, "off")
    products.product_kernel.cache_clear()
    for on, off in zip(with_kernel, logits(), strict=True):
        assert torch.equal(on, off)


def test_the_kernel_can_be_turned_off_and_a_failed_build_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(products.ENV, "off")
    with caplog.at_level("INFO", logger=products.__name__):
        assert products.product_kernel() is None
    assert "PyTorch's kernels (KAKEYA_PRODUCT_KERNEL=off)" in caplog.text
    monkeypatch.delenv(products.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    use_broken_compiler(monkeypatch, tmp_path, "no such cpu")
    products.product_kernel.cache_clear()
    with caplog.at_level("WARNING", logger=products.__name__):
        assert products.product_kernel() is None
    assert "the compiled kernel is unavailable" in caplog.text and "no such cpu" in caplog.text
    codes = _codes(20, 64, 4)
    x = torch.randint(-127, 128, (2, 64), dtype=torch.int8)
    assert torch.equal(products.row_sums(x, codes, products.code_offsets(codes)), torch._int_mm(x, codes.t()))


def _int4_layer(outputs: int, inputs: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed int4 weights [outputs, inputs / 2] and their scales and zero points [inputs / group, outputs, 2]."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (outputs, inputs), generator=generator, dtype=torch.int32)
    codes[0] = 15  # the extreme codes
    codes[1] = 0
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    qparams = (torch.randn(inputs // group, outputs, 2, generator=generator) * 0.1).to(torch.bfloat16)
    return weight, qparams


@pytest.mark.parametrize(
    ("outputs", "inputs", "group"), [(64, 96, 32), (960, 576, 32), (192, 256, 64), (128, 64, 64), (160, 128, 32)]
)
@pytest.mark.parametrize("rows", [1, 4, 5, 7, 12, 64, 65, 130])
def test_int4_rows_are_pytorch_s_bit_for_bit_for_every_row_count_and_layer(int4_kernel, outputs, inputs, group, rows):
    weight, qparams = _int4_layer(outputs, inputs, group, rows)
    x = (torch.randn(rows, inputs, generator=torch.Generator().manual_seed(outputs)) * 4).to(torch.bfloat16)
    x[0, :3] = torch.tensor([0.0, -1e-30, 3e4])  # a zero, a tiny and a large input
    expected = torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, group, qparams)
    assert torch.equal(int4_kernel.int4_product(x, weight, group, qparams, 2), expected)
    assert torch.equal(torch.ops.kakeya.int4_rows(x, weight, group, qparams), expected)


def test_int4_rows_leave_layers_the_kernel_does_not_serve_to_pytorch(int4_kernel, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(products.ProductKernel, "int4_product", lambda *args: calls.append(1))
    weight, qparams = _int4_layer(48, 64, 32, 0)  # 48 outputs: not whole blocks of 64
    x = torch.randn(9, 64).to(torch.bfloat16)
    expected = torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, 32, qparams)
    assert torch.equal(torch.ops.kakeya.int4_rows(x, weight, 32, qparams), expected)
    assert calls == []


def test_int4_rows_stay_pytorch_s_where_it_runs_another_int4_kernel(int4_kernel, monkeypatch, caplog):
    other = "AVX2"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other)
    products.product_kernel.cache_clear()
    with caplog.at_level("INFO", logger=products.__name__):
        kernel = products.product_kernel()
    assert kernel is None or not kernel.serves_int4
    assert f"PyTorch runs its {other} int4 kernel" in caplog.text


def test_a_verifier_s_blocks_run_their_int4_layers_on_the_kernel_with_the_same_logits(
    checkpoints, int4_kernel, monkeypatch
):
    calls: list[int] = []
    product = products.ProductKernel.int4_product

    def counting(self, rows, *args):
        calls.append(int(rows.shape[0]))
        return product(self, rows, *args)

    def logits() -> list[torch.Tensor]:
        verifier = TorchVerifier.load(checkpoints["llama"], device="cpu", dtype="float32", weights="int4")
        cache = verifier.new_cache(FullStrategy())
        out = []
        for block in (list(range(3, 40)), [40], [41, 42, 43, 44, 45, 46]):  # a prefill, a step, a verify block
            out.append(verifier.verify(cache, block, len(block)).logits.clone())
            verifier.commit(cache, len(block))
        return out

    monkeypatch.setattr(products.ProductKernel, "int4_product", counting)
    # the float head and int4 over quantized rows are the kernel's own arithmetic, not a PyTorch kernel's: both runs
    # hold the head and the block layers another way
    monkeypatch.setattr(weights_module, "float_head_serves", lambda width: False)
    monkeypatch.setattr(weights_module, "int4_qrows_serves", lambda outputs, width: False)
    with_kernel = logits()
    assert sorted(set(calls)) == [6, 37]  # every block of 5 or more rows; no lone step
    monkeypatch.setenv(products.ENV, "off")
    products.product_kernel.cache_clear()
    for on, off in zip(with_kernel, logits(), strict=True):
        assert torch.equal(on, off)


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
    tokens = list(range(3, 15))
    block = verifier.verify(verifier.new_cache(FullStrategy()), tokens, len(tokens)).logits.clone()  # [12, V]
    stepwise = verifier.new_cache(FullStrategy())
    verifier.verify(stepwise, tokens[:5], 5)
    verifier.commit(stepwise, 5)
    for i, token in enumerate(tokens[5:], start=5):
        assert torch.equal(verifier.verify(stepwise, [token], 1).logits[-1], block[i]), i
        verifier.commit(stepwise, 1)


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
    _assert_steps_meet_the_block(verifier)
