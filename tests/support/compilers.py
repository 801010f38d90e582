"""Builds of the compiled kernels the tests need besides the machine's own: one by a C compiler that fails (what the
kernels do when they cannot be built), and the attention kernel built without AVX-512 (its AVX2 path, on a CPU that
has AVX-512)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kv_cache_proposer.backends.torch_backend import held_kernel, kernel_build


def kernel_without_avx512() -> held_kernel.HeldKernel:
    """The attention kernel built for this CPU less AVX-512 (`-mno-avx512f`): on a CPU with AVX-512, its AVX2 path."""
    return held_kernel.load((*kernel_build.FLAGS, "-mno-avx512f"))


def use_broken_compiler(monkeypatch: pytest.MonkeyPatch, directory: Path, message: str) -> None:
    """Point `CC` at a compiler in `directory` that reports a version and fails every build with `message`."""
    broken = directory / "cc"
    broken.write_text(
        f"#!/bin/sh\n[ \"$1\" = --version ] && echo broken-cc 1.0 && exit 0\necho '{message}' >&2\nexit 1\n"
    )
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
