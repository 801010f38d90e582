"""Which kernel attends over dense K/V (`KAKEYA_DENSE_ATTENTION`): by default (`auto`) the compiled kernel where it
runs on the CPU's tile unit (bfloat16 queries and K/V), PyTorch's flash kernel for the rest; `compiled` and `flash`
for everything; an unknown value logged and read as `auto`."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from kv_cache_proposer.backends.torch_backend import exact_attention, held_kernel
from kv_cache_proposer.backends.torch_backend.direct import OVER_HISTORY


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


def test_auto_attends_bfloat16_on_the_tile_unit_and_float32_with_flash(fresh):
    kernel = held_kernel.held_kernel()
    if kernel is None or not kernel.tiles:
        pytest.skip("this CPU has no tile unit (AMX) the compiled kernel can use: auto is flash for every dtype")
    for dtype, same_as in ((torch.bfloat16, "compiled"), (torch.float32, "flash")):
        auto = _attended(fresh, "auto", dtype)
        assert torch.equal(auto, _attended(fresh, same_as, dtype)), dtype
    # the two kernels differ in their last bits, so the comparisons above tell which ran
    assert not torch.equal(_attended(fresh, "compiled", torch.bfloat16), _attended(fresh, "flash", torch.bfloat16))
    assert not torch.equal(_attended(fresh, "compiled", torch.float32), _attended(fresh, "flash", torch.float32))


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
