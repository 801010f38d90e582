"""Which way the torch backend's dense attention runs in a test: through PyTorch's flash kernel (the default), or
through the compiled kernel (held_kernel.c, `KAKEYA_DENSE_ATTENTION=compiled`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kv_cache_proposer.backends.torch_backend import exact_attention


@pytest.fixture(params=["flash", "compiled"])
def attention_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each of the two paths in turn."""
    yield from dense_attention(monkeypatch, request.param)


@pytest.fixture
def compiled_attention(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The compiled kernel."""
    yield from dense_attention(monkeypatch, "compiled")


def dense_attention(monkeypatch: pytest.MonkeyPatch, path: str) -> Iterator[str]:
    monkeypatch.setenv(exact_attention.DENSE_ENV, path)
    exact_attention.dense_kernel.cache_clear()
    try:
        if path == "compiled" and exact_attention.dense_kernel() is None:
            pytest.skip("no C compiler here to build the attention kernel; PyTorch's flash path is tested instead")
        yield path
    finally:
        exact_attention.dense_kernel.cache_clear()
