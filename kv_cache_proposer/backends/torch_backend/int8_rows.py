"""The int8 LM head's integer product for a decode step or a short block, on the compiled kernel (`int8_rows.c`):
a few int8 rows against the head's codes, read once in place with AVX512-VNNI dot products, where oneDNN's
`_int_mm` repacks the codes at every call. The sums are exact integers either way, so a token's logits are the
same bit for bit whichever computes them, and blocks of more rows than `MAX_ROWS` keep `_int_mm` (whose packed
product pays from there).

Built with the machine's C compiler on first use (`kernel_build`); where that fails, the CPU has no AVX512-VNNI or
`KAKEYA_INT8_ROWS=off` asks, `_int_mm` computes every product. Which runs is logged once, with the reason."""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from kv_cache_proposer.backends.torch_backend.kernel_build import built

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int8_rows.c")
ENV = "KAKEYA_INT8_ROWS"
MAX_ROWS = 6
"""Input rows (a split product's parts: two per token) up to which the kernel computes a product: measured against
`_int_mm` on the default model's head (49,152 × 576), one and two threads (docs/models.md#the-lm-heads-product)."""

_P = ctypes.c_void_p


@dataclass(frozen=True, slots=True)
class Int8Rows:
    """The loaded kernel and where its library lies."""

    function: Any
    library: Path

    def sums(self, rows: torch.Tensor, codes: torch.Tensor, offsets: torch.Tensor, threads: int) -> torch.Tensor:
        """`rows @ codes.T` for int8 `rows` [M, in] (each value in [-127, 127]) and int8 `codes` [out, in] whose
        rows are contiguous, `offsets` from `code_offsets(codes)`: int32 [M, out] (a transposed view)."""
        rows = rows.contiguous()
        count, width = (int(s) for s in rows.shape)
        outputs = int(codes.shape[0])
        if codes.stride(1) != 1 or int(codes.shape[1]) != width:
            raise ValueError("the int8 row kernel reads code rows of contiguous values as long as the input rows")
        out = torch.empty(outputs, count, dtype=torch.int32)
        status = self.function(
            rows.data_ptr(),
            count,
            codes.data_ptr(),
            outputs,
            width,
            int(codes.stride(0)),
            offsets.data_ptr(),
            out.data_ptr(),
            threads,
        )
        if status != 0:
            raise ValueError(f"the int8 row kernel does not serve {count} rows of {width} values")
        return out.t()


def code_offsets(codes: torch.Tensor) -> torch.Tensor:
    """128 × the sum of each code row, int32 [out]: what the kernel takes off the sums of rows it reads shifted by
    128 (its dot products multiply unsigned by signed bytes)."""
    return (codes.sum(dim=1, dtype=torch.int32) * 128).to(torch.int32).contiguous()


def row_sums(rows: torch.Tensor, codes: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """Exact int32 sums `rows @ codes.T` [M, out] of int8 `rows` [M, in] and `codes` [out, in]: on the kernel where
    `offsets` are given, it is loaded and the rows are few, else `_int_mm`."""
    kernel = int8_rows() if offsets is not None and rows.shape[0] <= MAX_ROWS else None
    if kernel is None or offsets is None:
        return torch._int_mm(rows, codes.t())
    return kernel.sums(rows, codes, offsets, torch.get_num_threads())


@cache
def int8_rows() -> Int8Rows | None:
    """The kernel, built if needed, or None (the reason logged) where it cannot be, does not serve this CPU or is
    turned off."""
    setting = os.environ.get(ENV, "auto").strip().lower()
    if setting in ("off", "0", "false", "no"):
        log.info("int8 head product: oneDNN's _int_mm (%s=%s)", ENV, setting)
        return None
    try:
        library = built(SOURCE)
        loaded = ctypes.CDLL(str(library))
        function, served = loaded.int8_row_sums, loaded.int8_rows_served
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("int8 head product: oneDNN's _int_mm, the compiled kernel is unavailable (%s)", exc)
        return None
    function.argtypes = [_P, ctypes.c_int, _P, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, _P, _P, ctypes.c_int]
    function.restype = ctypes.c_int
    served.argtypes, served.restype = [], ctypes.c_int
    if not served():
        log.info("int8 head product: oneDNN's _int_mm (this CPU has no AVX512-VNNI)")
        return None
    log.info("int8 head product: compiled kernel %s for blocks of up to %d rows", library, MAX_ROWS)
    return Int8Rows(function, library)
