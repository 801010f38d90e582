"""`use_mlx_blas` in a process where MLX has loaded (as in this test process): a library can no longer be chosen, a
path is refused, `auto` keeps the bundled library and says why; off Linux there is nothing to choose.
tests/integration/test_mlx_blas.py loads OpenBLAS for real, in fresh processes."""

from __future__ import annotations

import ctypes.util
import sys

import mlx.core  # noqa: F401  (MLX loaded, as in a process that imported it before choosing)
import pytest

from kv_cache_proposer.backends import mlx_blas
from kv_cache_proposer.backends.mlx_blas import MlxBlas, use_mlx_blas


@pytest.fixture(autouse=True)
def nothing_chosen(monkeypatch):
    monkeypatch.setattr(mlx_blas, "_active", MlxBlas(note="not chosen"))


def test_once_mlx_has_loaded_a_path_is_refused_and_auto_keeps_the_bundled_library_saying_why(monkeypatch):
    with pytest.raises(ValueError, match="MLX is already loaded in this process"):
        use_mlx_blas(sys.executable)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: sys.executable)
    chosen = use_mlx_blas("auto")
    assert chosen.bundled and chosen.note == "MLX was loaded before a BLAS could be chosen"
    assert str(chosen) == "bundled (MLX was loaded before a BLAS could be chosen)"
    assert mlx_blas.active_mlx_blas() == chosen


def test_auto_without_a_system_openblas_keeps_the_bundled_library_and_says_how_to_get_one(monkeypatch):
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    chosen = use_mlx_blas("auto")
    assert chosen.bundled and "apt install libopenblas0-pthread" in chosen.note
    assert use_mlx_blas("bundled") == MlxBlas() and str(MlxBlas()) == "bundled"


def test_a_path_that_does_not_exist_is_refused_before_anything_loads():
    with pytest.raises(ValueError, match="no such file"):
        use_mlx_blas("/nonexistent/libopenblas.so.0")
    assert mlx_blas.active_mlx_blas().note == "not chosen"


def test_off_linux_auto_chooses_nothing_and_a_path_is_refused(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert use_mlx_blas("auto") == MlxBlas(note="MLX on darwin uses its platform's BLAS")
    with pytest.raises(ValueError, match="on Linux only"):
        use_mlx_blas("/opt/lib/libopenblas.dylib")
