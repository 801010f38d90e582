"""How the compiled kernels are built (kernel_build.py): several sources into one library, named by their contents
and by the local headers they include, so that a changed header builds a new library and an unchanged tree reuses
the one it built."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from kv_cache_proposer.backends.torch_backend import kernel_build

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here to build a kernel"
)


def _tree(root: Path, constant: int) -> tuple[Path, Path]:
    (root / "shared.h").write_text('#include "inner.h"\nstatic inline int twice(int x) { return 2 * x; }\n')
    (root / "inner.h").write_text(f"#define CONSTANT {constant}\n")
    (root / "first.c").write_text('#include "shared.h"\nint first(void) { return twice(CONSTANT); }\n')
    (root / "second.c").write_text('#include "shared.h"\nint second(void) { return twice(CONSTANT) + 1; }\n')
    return root / "first.c", root / "second.c"


def test_sources_build_into_one_library_named_by_their_headers(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sources = _tree(tmp_path, 20)
    assert kernel_build._included(sources[0]) == {tmp_path / "shared.h", tmp_path / "inner.h"}
    library = kernel_build.built(sources, ("-O1", "-fPIC", "-shared"))
    loaded = ctypes.CDLL(str(library))
    assert (loaded.first(), loaded.second()) == (40, 41)  # both sources, one library
    assert kernel_build.built(sources, ("-O1", "-fPIC", "-shared")) == library  # built once

    (tmp_path / "inner.h").write_text("#define CONSTANT 30\n")  # a header two levels down changed
    rebuilt = kernel_build.built(sources, ("-O1", "-fPIC", "-shared"))
    assert rebuilt != library
    assert ctypes.CDLL(str(rebuilt)).second() == 61


def test_a_source_without_local_headers_is_named_by_itself_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "alone.c"
    source.write_text("int alone(void) { return 7; }\n")
    (tmp_path / "unrelated.h").write_text("#define UNRELATED 1\n")
    library = kernel_build.built(source, ("-O1", "-fPIC", "-shared"))
    (tmp_path / "unrelated.h").write_text("#define UNRELATED 2\n")  # not included: the same library
    assert kernel_build.built(source, ("-O1", "-fPIC", "-shared")) == library
    assert ctypes.CDLL(str(library)).alone() == 7
