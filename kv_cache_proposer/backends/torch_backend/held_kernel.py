"""The compiled CPU kernel for attention (`held_kernel.c` over held coordinates, `dense_kernel.c` over dense K/V, one
library): built with the machine's C compiler on first use, for this CPU (`kernel_build`), and loaded with ctypes.
Over held coordinates, a decode step or a speculative block reads the int8 coordinates in one pass, never writing a
float32 copy of them (`TorchHeldKeys`). Over dense K/V, it serves `exact_attention.attend_exact` as
`KAKEYA_DENSE_ATTENTION` says (by default bfloat16 K/V where the CPU multiplies bfloat16, AVX512-BF16 or AMX, or has
AVX2 but not AVX-512, and float32 K/V where it has AVX-512 or AVX2).

Where no compiler is found or the build fails, held attention runs as TorchScript ops instead (the same values within
float rounding, slower at long histories); `KAKEYA_HELD_KERNEL=off` asks for that path. Which path runs is logged
once, with the reason."""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kv_cache_proposer.backends.torch_backend.dense_calls import DENSE_CALLS, DenseRow, readable, thread_scratch
from kv_cache_proposer.backends.torch_backend.kernel_build import FLAGS, SOURCES, built
from kv_cache_proposer.compression.codec import StagedCoding

log = logging.getLogger(__name__)

SEGMENT = 512
"""Held keys of one work item: a segment's partial result is merged with the others in order, so the boundaries are
fixed (multiples of it from the first key) whatever the thread count."""

MAX_ROWS = 512
"""Query rows (query heads per K/V head × queries) of one call at most: a segment's scores live on the stack."""

MAX_CALLS = 256
"""Calls of one `attend_dense_many` at most (`MAX_CALLS` of dense_kernel.c)."""

MAX_DIM = 256
"""The largest head size the kernel serves (`MAX_DIM` of attention_kernel.h)."""

ENV = "KAKEYA_HELD_KERNEL"

_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class _Call(ctypes.Structure):
    """`HeldCall` of held_kernel.c, field for field."""

    _fields_ = [
        ("q", _P),
        ("q_strides", _I64 * 3),
        ("q_bf16", _I),
        ("coords", _P),
        ("c_strides", _I64 * 3),
        ("norms", _P),
        ("qmax", _P),
        ("n_strides", _I64 * 3),
        ("count", _I64),
        ("q_range", _I),
        ("allowed", _P),
        ("s_allowed", _I64),
        ("tail_keys", _P),
        ("tail_values", _P),
        ("t_strides", _I64 * 3),
        ("tail_bf16", _I),
        ("tail_count", _I64),
        ("tail_allowed", _P),
        ("s_tail_allowed", _I64),
        ("hadamard", _P),
        ("scale", ctypes.c_float),
        ("B", _I),
        ("H", _I),
        ("g", _I),
        ("n", _I),
        ("D", _I),
        ("seg", _I64),
        ("threads", _I),
        ("tiles", _I),
        ("scratch", _P),
        ("out", _P),
        ("lse", _P),
        ("rounded", _I),
    ]


@dataclass(frozen=True, slots=True)
class HeldKernel:
    """The loaded kernel (attention over held coordinates, and over dense K/V) and where its library lies."""

    function: Any
    scratch_size: Any
    dense: Any
    dense_many: Any
    library: Path
    tiles: bool = False
    """Whether dense attention over bfloat16 queries and K/V runs on the CPU's tile unit (AMX): the kernel was built
    with it and Linux granted its state. Fixed for the process, so every block shape takes the same path."""
    bf16_products: bool = False
    """Whether dense attention multiplies bfloat16 queries and K/V as bfloat16 (the CPU has AVX512-BF16; true
    wherever `tiles` is)."""
    vector_bits: int = 0
    """The width of the vectors dense attention scores and sums on, float32 K/V included: 512 (AVX-512; wherever
    `bf16_products` is), 256 (AVX2 with FMA, on a CPU without AVX-512), 0 (its loops are plain C)."""

    @property
    def rounds_queries(self) -> bool:
        """Whether dense attention takes float32 queries over bfloat16 K/V with the casts to bfloat16 folded in
        (`rounded`): wherever it multiplies bfloat16 as float32 (without bfloat16 products, which read bfloat16)."""
        return not self.bf16_products and not self.tiles

    def attend(
        self,
        q: torch.Tensor,
        coding: StagedCoding[torch.Tensor],
        allowed: torch.Tensor | None,
        tail: tuple[torch.Tensor, torch.Tensor],
        tail_allowed: torch.Tensor | None,
        hadamard: torch.Tensor,
        scale: float,
        q_range: int,
        threads: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_held_attention` of the queries `q` `[B, H, n, D]` over a `coding` (int8 doubled coordinates
        `[2B, H_kv, c, D]`, fp16 norms and scales `[2B, H_kv, c, 1]`; `allowed` `[n, c]`, None: every key) and then
        the dense `tail` K/V `[B, H_kv, t, D]` (`tail_allowed` `[n, t]`), on `threads` threads: output
        `[B, H_kv, g·n, D]` and log-sum-exp `[B, H_kv, g·n, 1]`, float32. Where `self.tiles`, D is a multiple of 32
        and the rows number 8 or more, the held entries are scored and summed on the tile unit, the rotated queries
        and the weights rounded to bfloat16 (the coordinates are exact in it)."""
        doubled, norms, qmax = coding.doubled, coding.norms, coding.qmax
        batch, heads, n, dim = (int(s) for s in q.shape)
        kv_heads, count = int(doubled.shape[1]), int(doubled.shape[2])
        groups = heads // kv_heads
        rows = groups * n
        q, tail_keys, tail_values = (readable(x) for x in (q, *tail))
        hadamard = hadamard.float().contiguous()
        if doubled.stride(3) != 1 or norms.stride() != qmax.stride() or tail_keys.stride() != tail_values.stride():
            raise ValueError("the held-attention kernel reads rows of contiguous values, K and V laid out alike")
        scratch = thread_scratch(int(self.scratch_size(batch, kv_heads, rows, dim, count, SEGMENT)))
        out = torch.empty(batch, kv_heads, rows, dim)
        lse = torch.empty(batch, kv_heads, rows, 1)
        call = _Call(
            q=q.data_ptr(),
            q_strides=(_I64 * 3)(*q.stride()[:3]),
            q_bf16=int(q.dtype == torch.bfloat16),
            coords=doubled.data_ptr(),
            c_strides=(_I64 * 3)(*doubled.stride()[:3]),
            norms=norms.data_ptr(),
            qmax=qmax.data_ptr(),
            n_strides=(_I64 * 3)(*norms.stride()[:3]),
            count=count,
            q_range=q_range,
            allowed=None if allowed is None else allowed.data_ptr(),
            s_allowed=0 if allowed is None else int(allowed.stride(0)),
            tail_keys=tail_keys.data_ptr(),
            tail_values=tail_values.data_ptr(),
            t_strides=(_I64 * 3)(*tail_keys.stride()[:3]),
            tail_bf16=int(tail_keys.dtype == torch.bfloat16),
            tail_count=int(tail_keys.shape[2]),
            tail_allowed=None if tail_allowed is None else tail_allowed.data_ptr(),
            s_tail_allowed=0 if tail_allowed is None else int(tail_allowed.stride(0)),
            hadamard=hadamard.data_ptr(),
            scale=scale,
            B=batch,
            H=kv_heads,
            g=groups,
            n=n,
            D=dim,
            seg=SEGMENT,
            threads=threads,
            tiles=int(self.tiles),
            scratch=scratch.data_ptr(),
            out=out.data_ptr(),
            lse=lse.data_ptr(),
        )
        if self.function(ctypes.byref(call)) != 0:
            raise ValueError(f"the held-attention kernel does not serve {rows} query rows of head size {dim}")
        return out, lse

    def attend_dense(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        hi: torch.Tensor,
        allowed: torch.Tensor | None,
        scale: float,
        threads: int,
        with_lse: bool = True,
        rounded: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of the queries `q` `[B, H, n, D]` over dense K/V `[B, H_kv, c, D]` (float32 or bfloat16),
        query i reading keys below `hi[i]` (int64 `[n]`) that `allowed` (uint8 `[n, c]`, None: all)
        allows, on `threads` threads: output `[B, H_kv, g·n, D]` and log-sum-exp `[B, H_kv, g·n, 1]` (None unless
        `with_lse`), float32. A query's values do not depend on the queries beside it, the batch or the thread
        count. Where `self.tiles`, bfloat16 runs on the tile unit. `rounded` (float32 queries over bfloat16 K/V,
        where `rounds_queries`): the values of the queries cast to bfloat16 and the output cast to bfloat16 and
        back, the casts done by the kernel as it reads and writes."""
        dense = DenseRow(q, keys, values, hi, allowed, with_lse, rounded=rounded)
        scratch = thread_scratch(dense.scratch_floats(self.scratch_size, SEGMENT))
        call = np.array([dense.fields(self.tiles, SEGMENT, scratch.data_ptr(), scale, threads)], dtype=DENSE_CALLS)
        if self.dense(call.ctypes.data) != 0:
            rows, dim = dense.rows, dense.dim
            raise ValueError(f"the dense-attention kernel does not serve {rows} query rows of head size {dim}")
        return dense.out, dense.lse

    def attend_dense_rows(
        self,
        q: torch.Tensor,
        rows: Sequence[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]],
        scale: float,
        threads: int,
        rounded: bool = False,
    ) -> torch.Tensor:
        """`attend_dense` of several independent rows of a packed batched forward in one parallel region, their
        work shared by the threads: the queries `q` `[1, H, T, D]` hold every row's, row `(start, end, keys, values,
        hi, allowed)` its queries `[start, end)` over its own K/V. Returns the output `[1, H, T, D]`, float32, each
        row's queries holding what `attend_dense` gives that row alone, bit for bit (each writes its own span);
        `rounded` as `attend_dense` takes it."""
        out = torch.empty(q.shape, dtype=torch.float32)
        q = readable(q)
        dense = [
            DenseRow(
                q.narrow(2, start, end - start),
                keys,
                values,
                hi,
                allowed,
                False,
                out.narrow(2, start, end - start),
                rounded=rounded,
            )
            for start, end, keys, values, hi, allowed in rows
        ]
        sizes = [row.scratch_floats(self.scratch_size, SEGMENT) for row in dense]
        scratch = thread_scratch(sum(sizes))
        base, offset, fields = scratch.data_ptr(), 0, []
        for row, size in zip(dense, sizes, strict=True):
            fields.append(row.fields(self.tiles, SEGMENT, base + 4 * offset, scale, threads))
            offset += size
        calls = np.array(fields, dtype=DENSE_CALLS)
        if self.dense_many(calls.ctypes.data, len(dense), threads) != 0:
            raise ValueError(f"the dense-attention kernel does not serve these {len(dense)} rows")
        return out


def serves(q: torch.Tensor, doubled: torch.Tensor, kv_heads: int) -> bool:
    """Whether the kernel can read these queries `[B, H, n, D]` over these coordinates."""
    rows = int(q.shape[1]) // kv_heads * int(q.shape[2])
    return (
        q.device.type == "cpu"
        and doubled.dtype == torch.int8
        and int(doubled.shape[3]) <= MAX_DIM
        and rows <= MAX_ROWS
        and held_kernel() is not None
    )


def reads_blocks(q: torch.Tensor, doubled: torch.Tensor, kv_heads: int) -> bool:
    """Whether the kernel reads a block of many queries (a prefill chunk, `MAX_ROWS` rows a call) faster than the
    flash kernel over decoded chunks: where it multiplies bfloat16 (AVX512-BF16 or a tile unit) and the head size is
    a multiple of 64 (scores and value sums both on bfloat16 pairs)."""
    if int(doubled.shape[3]) % 64 != 0 or not serves(q[:, :, :1], doubled, kv_heads):  # one query's rows a call
        return False
    kernel = held_kernel()
    return kernel is not None and kernel.bf16_products


@cache
def held_kernel() -> HeldKernel | None:
    """The kernel, built if needed, or None (the reason logged) where it cannot be or is turned off."""
    setting = os.environ.get(ENV, "auto").strip().lower()
    if setting in ("off", "0", "false", "no"):
        log.info("held attention: TorchScript ops (%s=%s)", ENV, setting)
        return None
    try:
        kernel = load()
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("held attention: TorchScript ops, the compiled kernel is unavailable (%s)", exc)
        return None
    unit = " (tile unit for bfloat16)" if kernel.tiles else ""
    log.info("held attention: compiled kernel %s%s", kernel.library, unit)
    return kernel


def load(flags: tuple[str, ...] = FLAGS) -> HeldKernel:
    """The kernel built with `flags` (by default for everything this CPU has) and loaded; raises where it cannot be
    (no compiler, a failed build). A build for less than the CPU has (`-mno-avx512f`, say) runs another vector
    path of the same kernel."""
    library = built(SOURCES, flags)
    loaded = ctypes.CDLL(str(library))
    function, scratch_size, dense = loaded.held_attend, loaded.held_attend_scratch, loaded.dense_attend
    dense_many = loaded.dense_attend_many
    tiles_enable = loaded.dense_tiles_enable
    bf16_products, vectors = loaded.dense_bf16_products, loaded.dense_vectors
    function.argtypes, function.restype = [ctypes.POINTER(_Call)], _I
    scratch_size.argtypes, scratch_size.restype = [_I, _I, _I, _I, _I64, _I64], _I64
    dense.argtypes, dense.restype = [_P], _I  # an array of `DENSE_CALLS`
    dense_many.argtypes, dense_many.restype = [_P, _I, _I], _I
    tiles_enable.argtypes, tiles_enable.restype = [], _I
    for flag in (bf16_products, vectors):
        flag.argtypes, flag.restype = [], _I
    tiles = bool(tiles_enable())
    return HeldKernel(function, scratch_size, dense, dense_many, library, tiles, bool(bf16_products()), int(vectors()))
