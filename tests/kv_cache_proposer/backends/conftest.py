"""Which way the torch backend's dense attention runs in a test: through PyTorch's flash kernel
(`KAKEYA_DENSE_ATTENTION=flash`), or through the compiled kernel (dense_kernel.c, `compiled`), whose bfloat16 path runs
on the CPU's tile unit where it has one and on its vector units otherwise. A test that names neither runs the
default, `auto`. And the product kernel (products.c, avx2_products.c) as a test finds it."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator

import pytest

from kv_cache_proposer.backends.torch_backend import exact_attention, held_kernel, products
from tests.support.compilers import kernel_without_avx512


@pytest.fixture(params=["flash", "compiled"])
def attention_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each of the two paths in turn."""
    yield from dense_attention(monkeypatch, request.param)


@pytest.fixture(params=["tiles", "vectors", "avx2"])
def compiled_attention(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The compiled kernel, its bfloat16 attention on the tile unit (where the CPU has one) and on the vector units;
    and on a CPU with AVX-512, the kernel built without it, so that its AVX2 path is tested there too."""
    chosen = exact_attention.dense_kernel
    for path in dense_attention(monkeypatch, "compiled"):
        kernel = chosen()
        assert kernel is not None
        if request.param == "tiles" and not kernel.tiles:
            pytest.skip("this CPU has no tile unit (AMX) the kernel can use; its vector path is tested instead")
        if request.param == "vectors":
            monkeypatch.setattr(exact_attention, "dense_kernel", _always(dataclasses.replace(kernel, tiles=False)))
        if request.param == "avx2":
            if kernel.vector_bits != 512:
                pytest.skip(f"the kernel's own build runs {kernel.vector_bits}-bit vectors here (tested as `vectors`)")
            narrower = kernel_without_avx512()
            assert narrower.vector_bits == 256 and not narrower.tiles and not narrower.bf16_products
            monkeypatch.setattr(exact_attention, "dense_kernel", _always(narrower))
        try:
            yield path
        finally:  # the choice's own cache is cleared after the test (dense_attention)
            monkeypatch.setattr(exact_attention, "dense_kernel", chosen)


def dense_attention(monkeypatch: pytest.MonkeyPatch, path: str) -> Iterator[str]:
    monkeypatch.setenv(exact_attention.DENSE_ENV, path)
    exact_attention.dense_setting.cache_clear()
    exact_attention.dense_kernel.cache_clear()
    try:
        if path == "compiled" and exact_attention.dense_kernel() is None:
            pytest.skip("no C compiler here to build the attention kernel; PyTorch's flash path is tested instead")
        yield path
    finally:
        exact_attention.dense_setting.cache_clear()
        exact_attention.dense_kernel.cache_clear()


def _always(kernel: held_kernel.HeldKernel) -> Callable[[], held_kernel.HeldKernel]:
    """A stand-in for `exact_attention.dense_kernel` that chooses `kernel`."""

    @functools.cache
    def dense_kernel() -> held_kernel.HeldKernel:
        return kernel

    return dense_kernel


@pytest.fixture
def fresh_product_kernel() -> Iterator[None]:
    """The product kernel loaded afresh in the test (as its settings and CPU stand there) and forgotten after."""
    products.product_kernel.cache_clear()
    yield
    products.product_kernel.cache_clear()


@pytest.fixture
def kernel(fresh_product_kernel: None) -> products.ProductKernel:
    """The loaded product kernel, or a skip where there is none (no compiler, or nothing it serves on this CPU)."""
    loaded = products.product_kernel()
    if loaded is None:
        pytest.skip("no C compiler, or neither AVX2 nor AVX-512 on this CPU: PyTorch's kernels run")
    return loaded
