"""How the compiled CPU kernels (`held_kernel.c` and `dense_kernel.c`: attention, one library; `products.c`;
`avx2_products.c` and `layer_spans.c`, one library: linear layers' products and the spans between attentions) are
built: with the machine's C compiler, for this CPU (`-march=native`), once per sources and the local headers they
include, flags, compiler and CPU, into `$XDG_CACHE_HOME/kakeya/kernels` (else `~/.cache/kakeya/kernels`);
`held_kernel` and `products` load what this builds."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = (Path(__file__).with_name("held_kernel.c"), Path(__file__).with_name("dense_kernel.c"))
"""The attention kernel's sources, built together into one library (they share the `attention_*.h` headers)."""
EXACT_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared") + (
    ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()
)
"""Flags of a kernel whose float arithmetic is written out operation by operation (`products.c`, `avx2_products.c`)."""
FLAGS = (
    *EXACT_FLAGS,
    # Sums may be reassociated (vectorised reductions); infinities and NaNs keep their meaning (masked keys are -inf).
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
)


def kernel_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kakeya" / "kernels"


def built(sources: Path | tuple[Path, ...] = SOURCES, flags: tuple[str, ...] = FLAGS) -> Path:
    """The library of `sources` (one file, or several built together) built with `flags` for this compiler and CPU,
    compiled into the cache directory unless it is there. The local headers they include are part of what names the
    build, so a changed header builds a new library."""
    files = (sources,) if isinstance(sources, Path) else sources
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH; set CC to one")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    headers = sorted({header for source in files for header in _included(source)})
    key = hashlib.sha256()
    for part in (
        *(path.read_bytes() for path in (*files, *headers)),
        " ".join(flags).encode(),
        version.encode(),
        _cpu_flags().encode(),
    ):
        key.update(part)
    library = kernel_dir() / f"{files[0].stem}-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        done = subprocess.run(
            [compiler, *flags, "-o", str(built), *(str(source) for source in files)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(built, library)  # atomic: another process building the same library meanwhile is harmless
    return library


def _included(source: Path) -> set[Path]:
    """The local headers (`#include "name.h"`, beside `source`) that `source` includes, and the ones they include."""
    found: set[Path] = set()
    pending = [source]
    while pending:
        for match in re.finditer(r'^#include "([^"]+)"', pending.pop().read_text(), re.MULTILINE):
            header = source.parent / match.group(1)
            if header not in found:
                found.add(header)
                pending.append(header)
    return found


def _cpu_flags() -> str:
    """What `-march=native` builds for: the CPU's model and feature flags (empty where /proc/cpuinfo is absent)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(wanted[:2])
