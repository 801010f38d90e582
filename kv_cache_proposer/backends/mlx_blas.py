"""The CBLAS library behind MLX's CPU matrix products on Linux.

The Linux `mlx[cpu]` wheel links the reference BLAS it bundles, which multiplies matrices in plain loops: a prefill's
linear layers and a long history's attention products run several times slower than in an optimised BLAS. MLX binds
`cblas_sgemm` and the other CBLAS symbols by name when `mlx.core` loads, and the dynamic linker looks a name up in
the libraries loaded with global visibility before a library's own dependencies. Loading an optimised CBLAS (the
system OpenBLAS) that way before MLX loads makes MLX call it instead; no file of MLX changes.

This module never imports MLX: the choice must happen before anything else in the process imports `mlx.core`.
On macOS MLX uses Accelerate (and the GPU), so there is nothing to choose.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from dataclasses import dataclass
from pathlib import Path

MLX_BLAS_CHOICES = ("auto", "bundled")
_INSTALL_HINT = "on Debian or Ubuntu `apt install libopenblas0-pthread` provides one"


@dataclass(frozen=True, slots=True)
class MlxBlas:
    """The CBLAS library MLX's CPU kernels call: `library` is `bundled` (the wheel's own) or the path loaded;
    `note` says why `auto` kept the bundled one."""

    library: str = "bundled"
    note: str = ""

    @property
    def bundled(self) -> bool:
        return self.library == "bundled"

    def __str__(self) -> str:
        return f"{self.library} ({self.note})" if self.note else self.library


_active = MlxBlas(note="not chosen")


def active_mlx_blas() -> MlxBlas:
    """The CBLAS library this process gave MLX (`use_mlx_blas`)."""
    return _active


def use_mlx_blas(choice: str) -> MlxBlas:
    """Make `choice` the CBLAS library MLX's CPU kernels call, before MLX loads.

    `bundled` keeps the wheel's reference BLAS; `auto` loads the system OpenBLAS on Linux when there is one and keeps
    the bundled library otherwise (the returned `note` says why); a path loads that shared library, which must export
    `cblas_sgemm`. Raises `ValueError` for a path that cannot be used, and for any library asked for once MLX has
    loaded (its symbols are bound by then). Choosing again what is already loaded changes nothing.
    """
    global _active
    if choice == "bundled":
        _active = MlxBlas() if _active.bundled else _active
        return _active
    explicit = choice != "auto"
    if sys.platform != "linux":
        if explicit:
            raise ValueError(f"mlx_blas {choice!r}: a CBLAS library is chosen on Linux only")
        _active = MlxBlas(note=f"MLX on {sys.platform} uses its platform's BLAS")
        return _active
    path = choice if explicit else ctypes.util.find_library("openblas")
    if path is None:
        _active = MlxBlas(note=f"no system OpenBLAS found; {_INSTALL_HINT}")
        return _active
    if not _active.bundled and _active.library == path:
        return _active
    if explicit and not Path(path).is_file():
        raise ValueError(f"mlx_blas {choice!r}: no such file")
    if "mlx.core" in sys.modules:
        if explicit:
            raise ValueError(f"mlx_blas {choice!r}: MLX is already loaded in this process, bound to its own BLAS")
        _active = MlxBlas(note="MLX was loaded before a BLAS could be chosen")
        return _active
    try:
        library = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise ValueError(f"mlx_blas {choice!r}: cannot load it: {exc}") from None
    if not hasattr(library, "cblas_sgemm"):
        raise ValueError(f"mlx_blas {choice!r}: it exports no cblas_sgemm, so it is not a CBLAS library")
    if not _resolves_globally(library, "cblas_sgemm"):
        raise ValueError(f"mlx_blas {choice!r}: another cblas_sgemm is already visible to the whole process")
    _active = MlxBlas(library=path)
    return _active


def _resolves_globally(library: ctypes.CDLL, symbol: str) -> bool:
    """Whether a library loaded from now on that needs `symbol` gets `library`'s definition of it."""
    own = ctypes.cast(getattr(library, symbol), ctypes.c_void_p).value
    visible = ctypes.cast(getattr(ctypes.CDLL(None), symbol), ctypes.c_void_p).value
    return own is not None and own == visible
