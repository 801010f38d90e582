"""Linear layers' products on the compiled kernel's exact stand-ins (`products.c`): the int8 head's integer sums are
`_int_mm`'s for every width, row count and value, and int4 rows are `_weight_int4pack_mm_for_cpu`'s bit for bit for
every row count and layer shape, so a token's logits are the same whichever computes them, through the verifier's
forwards too; turned off or failing to build, PyTorch's kernels compute every product (the kernel's own arithmetic:
test_avx2_products.py)."""

from __future__ import annotations

import pytest
import torch

from kv_cache_proposer.backends.torch_backend import products
from kv_cache_proposer.backends.torch_backend import weights as weights_module
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.backends.torch_backend.weights import (
    INT8_SPLIT,
    PackedLinear,
    integer_head_product,
)
from kv_cache_proposer.strategies import FullStrategy
from tests.support.compilers import use_broken_compiler

pytestmark = pytest.mark.usefixtures("one_torch_thread", "fresh_product_kernel")


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
            "(a CPU with AVX2 only multiplies int4 layers by quantized rows: test_avx2_products.py)"
        )
    assert kernel.serves_int4, "the kernel's int4 rows differ from PyTorch's (its self-check at load failed)"
    return kernel


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

    # int4 over quantized rows is the kernel's own arithmetic, not a PyTorch kernel's: both runs hold the block
    # layers another way
    monkeypatch.setattr(weights_module, "int4_qrows_serves", lambda outputs, width: False)
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
    ("outputs", "inputs", "group"), [(64, 96, 32), (960, 576, 32), (192, 256, 64), (128, 64, 64), (320, 128, 32)]
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
