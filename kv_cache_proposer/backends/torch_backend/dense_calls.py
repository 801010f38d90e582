"""How Python hands the attention kernel (`dense_kernel.c`) a call over dense K/V: the call's structure, a call's
inputs as the kernel reads them and its output tensors (`DenseRow`), and the scratch each thread reuses."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import torch

_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class DenseCall(ctypes.Structure):
    """`DenseCall` of dense_kernel.c, field for field."""

    _fields_ = [
        ("q", _P),
        ("q_strides", _I64 * 3),
        ("q_bf16", _I),
        ("keys", _P),
        ("values", _P),
        ("k_strides", _I64 * 3),
        ("v_strides", _I64 * 3),
        ("kv_bf16", _I),
        ("count", _I64),
        ("hi", _P),
        ("allowed", _P),
        ("s_allowed", _I64),
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
        ("o_strides", _I64 * 3),
        ("lse", _P),
        ("rounded", _I),
    ]


DENSE_CALLS = np.dtype(DenseCall)
"""`DenseCall`s as a NumPy array's rows (its layout is the structure's): a call's fields are written as one tuple."""


class DenseRow:
    """One call of dense attention: its inputs as the kernel reads them and its output tensors."""

    def __init__(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        hi: torch.Tensor,
        allowed: torch.Tensor | None,
        with_lse: bool,
        out: torch.Tensor | None = None,
        *,
        rounded: bool = False,
    ) -> None:
        self.batch, heads, self.n, self.dim = (int(s) for s in q.shape)
        self.kv_heads, self.count = int(keys.shape[1]), int(keys.shape[2])
        self.groups = heads // self.kv_heads
        self.rows = self.groups * self.n
        self.q, self.keys, self.values = (readable(x) for x in (q, keys, values))
        if self.keys.dtype != self.values.dtype:
            self.values = self.values.to(self.keys.dtype)
        self.hi, self.allowed, self.rounded = hi, allowed, rounded
        if rounded and (self.q.dtype != torch.float32 or self.keys.dtype != torch.bfloat16):
            raise ValueError("rounded attention reads float32 queries over bfloat16 K/V")
        # [B, H_kv, g·n, D] (viewed as [B, H, n, D]) unless the caller's `[B, H, n, D]` float32 view, rows contiguous
        self.out = torch.empty(self.batch, self.kv_heads, self.rows, self.dim) if out is None else out
        self.lse = torch.empty(self.batch, self.kv_heads, self.rows, 1) if with_lse else None

    def scratch_floats(self, scratch_size: Any, segment: int) -> int:
        """Floats of scratch the call needs (`scratch_size`: the kernel's function, keys read `segment` at a time)."""
        return int(scratch_size(self.batch, self.kv_heads, self.rows, self.dim, self.count, segment))

    def fields(self, tiles: bool, segment: int, scratch: int, scale: float, threads: int) -> tuple[Any, ...]:
        """The call as a `DenseCall`'s fields, in order (a row of `DENSE_CALLS`)."""
        q, keys, values, allowed, lse = self.q, self.keys, self.values, self.allowed, self.lse
        return (
            q.data_ptr(),
            q.stride()[:3],
            q.dtype == torch.bfloat16,
            keys.data_ptr(),
            values.data_ptr(),
            keys.stride()[:3],
            values.stride()[:3],
            keys.dtype == torch.bfloat16,
            self.count,
            self.hi.data_ptr(),
            0 if allowed is None else allowed.data_ptr(),
            0 if allowed is None else allowed.stride(0),
            scale,
            self.batch,
            self.kv_heads,
            self.groups,
            self.n,
            self.dim,
            segment,
            threads,
            tiles,
            scratch,
            self.out.data_ptr(),
            self._out_strides(),
            0 if lse is None else lse.data_ptr(),
            int(self.rounded),
        )

    def _out_strides(self) -> tuple[int, int, int]:
        """The output's strides by batch, query head and query."""
        out = self.out
        if out.dim() == 4 and int(out.shape[1]) == self.kv_heads * self.groups:  # [B, H, n, D]
            return int(out.stride(0)), int(out.stride(1)), int(out.stride(2))
        return int(out.stride(0)), self.n * self.dim, self.dim  # [B, H_kv, g·n, D], contiguous


_scratches = threading.local()
KEPT_SCRATCH = 1 << 22
"""Floats of scratch a thread keeps between calls at most (16 MiB: a prefill chunk's partial results over 8,192 keys
of the default model); a call that needs more allocates its own."""


def thread_scratch(size: int) -> torch.Tensor:
    """`size` floats of this thread's scratch for the kernel, reused from call to call (a fresh allocation of a
    prefill's partial results, several MB, costs its page faults every time)."""
    if size > KEPT_SCRATCH:
        return torch.empty(size)
    held: torch.Tensor | None = getattr(_scratches, "buffer", None)
    if held is None or held.numel() < size:
        held = _scratches.buffer = torch.empty(max(size, 1 << 16))
    return held[:size]


def readable(x: torch.Tensor) -> torch.Tensor:
    """`x` as the kernel reads it: float32 or bfloat16, each row's values contiguous."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()
