"""Which kernel attends over dense K/V (`KAKEYA_DENSE_ATTENTION`): by default (`auto`) the compiled kernel where the
CPU multiplies bfloat16 queries and K/V as bfloat16 (AVX512-BF16, or the tile unit) or has AVX2 but not AVX-512, and
for float32 ones where it has AVX-512 or AVX2, PyTorch's flash kernel for the rest; `compiled` and `flash` for
everything; an unknown value logged and read as `auto`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import pytest
import torch

from kv_cache_proposer.backends.torch_backend import exact_attention, held_kernel
from kv_cache_proposer.backends.torch_backend.direct import OVER_HISTORY
from tests.support.compilers import kernel_without_avx512


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The setting read afresh in the test, and again after it."""
    exact_attention.dense_setting.cache_clear()
    exact_attention.dense_kernel.cache_clear()
    yield monkeypatch
    exact_attention.dense_setting.cache_clear()
    exact_attention.dense_kernel.cache_clear()


def _attended(monkeypatch: pytest.MonkeyPatch, setting: str, dtype: torch.dtype) -> torch.Tensor:
    monkeypatch.setenv(exact_attention.DENSE_ENV, setting)
    exact_attention.dense_setting.cache_clear()
    exact_attention.dense_kernel.cache_clear()
    torch.manual_seed(5)
    q = torch.randn(1, 6, 40, 64, dtype=dtype)
    keys, values = (torch.randn(1, 2, 700, 64, dtype=dtype) for _ in "kv")
    return exact_attention.attend_exact(q, keys, values, OVER_HISTORY, 3, 0.125, {})


def test_auto_attends_bfloat16_and_float32_with_the_compiled_kernel_on_an_avx512_bf16_cpu(fresh):
    kernel = held_kernel.held_kernel()
    if kernel is None or not kernel.bf16_products:
        pytest.skip(
            "this CPU has no bfloat16 products (AVX512-BF16) the compiled kernel uses: auto attends bfloat16 K/V "
            "with flash here (the test below checks that choice on a kernel loaded as on such a CPU)"
        )
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(_attended(fresh, "auto", dtype), _attended(fresh, "compiled", dtype)), dtype
        # the two kernels differ in their last bits, so the comparison above tells which ran
        assert not torch.equal(_attended(fresh, "compiled", dtype), _attended(fresh, "flash", dtype)), dtype


@pytest.mark.parametrize(("vector_bits", "float32_by"), [(512, "compiled"), (0, "flash")])
def test_auto_attends_bfloat16_with_flash_where_the_cpu_has_no_bfloat16_products(fresh, vector_bits, float32_by):
    kernel = held_kernel.held_kernel()
    if kernel is None:
        pytest.skip("no C compiler here to build the attention kernel: auto is flash for every dtype")
    if vector_bits and kernel.vector_bits != vector_bits:
        pytest.skip("this CPU has no AVX-512: the kernel's 512-bit vector path cannot run here")
    # the kernel as it loads on a CPU with AVX-512 but not AVX512-BF16 (its vector path then converts bfloat16 to
    # float32), and as it loads on one without AVX2 or AVX-512 (plain C loops)
    as_loaded = dataclasses.replace(kernel, tiles=False, bf16_products=False, vector_bits=vector_bits)
    fresh.setattr(held_kernel, "held_kernel", lambda: as_loaded)
    auto = _attended(fresh, "auto", torch.bfloat16)
    assert torch.equal(auto, _attended(fresh, "flash", torch.bfloat16))
    assert not torch.equal(auto, _attended(fresh, "compiled", torch.bfloat16))
    assert torch.equal(_attended(fresh, "auto", torch.float32), _attended(fresh, float32_by, torch.float32))


def test_auto_attends_bfloat16_and_float32_with_the_compiled_kernel_on_an_avx2_cpu(fresh):
    kernel = held_kernel.held_kernel()
    if kernel is None:
        pytest.skip("no C compiler here to build the attention kernel: auto is flash for every dtype")
    if kernel.vector_bits == 512:  # the kernel as it builds on a CPU with AVX2 but not AVX-512
        kernel = kernel_without_avx512()
    if kernel.vector_bits != 256:
        pytest.skip("this CPU has no AVX2 with FMA: the kernel's 256-bit vector path cannot run here")
    fresh.setattr(held_kernel, "held_kernel", lambda: kernel)
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(_attended(fresh, "auto", dtype), _attended(fresh, "compiled", dtype)), dtype
        assert not torch.equal(_attended(fresh, "compiled", dtype), _attended(fresh, "flash", dtype)), dtype


def test_unset_is_auto_and_an_unknown_setting_is_logged_and_read_as_auto(fresh, caplog):
    fresh.delenv(exact_attention.DENSE_ENV, raising=False)
    assert exact_attention.dense_setting() == "auto"
    exact_attention.dense_setting.cache_clear()
    fresh.setenv(exact_attention.DENSE_ENV, "fastest")
    with caplog.at_level(logging.WARNING):
        assert exact_attention.dense_setting() == "auto"
    assert "KAKEYA_DENSE_ATTENTION=fastest is none of auto, compiled, flash" in caplog.text


def test_flash_never_loads_the_compiled_kernel(fresh):
    fresh.setenv(exact_attention.DENSE_ENV, "flash")
    assert exact_attention.dense_kernel() is None
