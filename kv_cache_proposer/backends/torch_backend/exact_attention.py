"""Attention on a CPU whose values for a query do not depend on the shape of the block around it (`attend_exact`),
so that a token's values do not depend on how its history was delivered or which sessions share its forward: keys
read in whole blocks of the flash kernel, query rows padded, the padded masks built once per forward (`Memo`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from functools import cache
from typing import Any, Final

import torch

from kv_cache_proposer.backends.torch_backend import held_kernel
from kv_cache_proposer.backends.torch_backend.chunked_attention import flash_cpu

log = logging.getLogger(__name__)

DENSE_ENV: Final = "KAKEYA_DENSE_ATTENTION"
"""`auto` (the default): the compiled kernel (`dense_kernel`) for bfloat16 queries and K/V where the CPU multiplies
them as bfloat16 (AVX512-BF16 dot products, or the tile unit, AMX) or has AVX2 but not AVX-512 (256-bit vectors),
and for float32 ones where it has AVX-512 or AVX2; PyTorch's CPU flash kernel otherwise;
`compiled`: the compiled kernel for every dtype; `flash`: PyTorch's flash kernel. Each gives a query the same values
however its history was delivered; the two agree within float rounding (docs/operator-guide.md#the-attention-kernel)."""
DENSE_SETTINGS: Final = ("auto", "compiled", "flash")

Memo = dict[tuple[Any, ...], Any]
"""The padded masks of one forward's attention, built once for all its layers (`attend_exact`); a forward
without one attends with the fastest kernel for each shape."""

# On a CPU, PyTorch's flash attention reads keys in blocks of 512 under one running softmax, and scores each block
# of query rows with a matrix product whose sums for a row are the same for any count of rows from 4 up. A row's
# values are then independent of the block's shape when every key block is whole (keys padded to a multiple of
# 512 and masked) and the rows of every product number 4 or more (rows padded to a multiple of 4): `attend_exact`.
KEY_BLOCK: Final = 512
ROW_MULTIPLE: Final = 4

DENSE_ROWS = 4096
"""Query rows (query heads per K/V head × queries) of one call of the compiled kernel at most (a prefill chunk of 512
queries of a model with up to 8 query heads per K/V head): its scratch holds every row's partial result per segment
of 512 keys."""


def attend_exact(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | str | None,
    groups: int,
    scale: float,
    memo: Memo,
) -> torch.Tensor:
    """Attention on a CPU whose values for a query do not depend on the block around it (`KEY_BLOCK`): each K/V
    head's query heads are rows of one query block (a grouped K/V head is never repeated), padded to a multiple of
    `ROW_MULTIPLE`; keys are read up to a multiple of `KEY_BLOCK` (from the cache's own room where it has some),
    the ones beyond the block's masked out. With `KAKEYA_DENSE_ATTENTION=compiled`, the compiled kernel
    (held_kernel.py) attends instead (`_attend_compiled`). Queries of another dtype than the K/V (float32 over
    bfloat16 K/V) meet them at the K/V's and the output returns at the queries': cast before and after, or, where
    the compiled kernel attends and `rounds_queries`, rounded by it as it reads and writes (the same values)."""
    if q.device.type == "cpu" and int(q.shape[3]) <= held_kernel.MAX_DIM:
        kernel = dense_kernel()
        compiled = dense_setting() == "compiled"
        if kernel is not None and (compiled or _auto_compiled(kernel, keys.dtype, int(q.shape[3]))):
            if q.dtype == keys.dtype:
                return _attend_compiled(kernel, q, keys, values, mask, groups, scale, memo)
            if _rounds(kernel, q, keys):
                return _attend_compiled(kernel, q, keys, values, mask, groups, scale, memo, rounded=True)
    if q.dtype != keys.dtype:
        return attend_exact(q.to(keys.dtype), keys, values, mask, groups, scale, memo).to(q.dtype)
    batch, heads, n, dim = q.shape
    kv_heads = heads // groups
    rows = groups * n
    padded_rows = max(ROW_MULTIPLE, rows + (-rows) % ROW_MULTIPLE)
    count = int(keys.shape[2])
    length = count + (-count) % KEY_BLOCK
    grouped = q.reshape(batch, kv_heads, rows, dim)
    if padded_rows != rows:
        grouped = torch.cat([grouped, grouped.new_zeros(batch, kv_heads, padded_rows - rows, dim)], dim=2)
    key = (mask if isinstance(mask, str) or mask is None else id(mask), n, count, groups, q.dtype)
    additive = memo.get(key)
    if additive is None:
        additive = memo[key] = _padded_mask(mask, n, count, groups, padded_rows, length, q.dtype)
    out, _ = flash_cpu(grouped, _with_room(keys, length), _with_room(values, length), attn_mask=additive, scale=scale)
    return out[:, :, :rows].reshape(batch, heads, n, dim)


@cache
def dense_setting() -> str:
    """`KAKEYA_DENSE_ATTENTION` (`DENSE_SETTINGS`; unset: `auto`); another value is logged and read as `auto`."""
    setting = os.environ.get(DENSE_ENV, "auto").strip().lower() or "auto"
    if setting not in DENSE_SETTINGS:
        log.warning("dense attention: %s=%s is none of %s; auto", DENSE_ENV, setting, ", ".join(DENSE_SETTINGS))
        return "auto"
    return setting


@cache
def dense_kernel() -> held_kernel.HeldKernel | None:
    """The compiled kernel where the setting may use it (`auto`, `compiled`) and it is built; None for PyTorch's
    flash kernel. Which runs is logged once, with the reason."""
    setting = dense_setting()
    kernel = held_kernel.held_kernel() if setting != "flash" else None
    if setting == "flash":
        log.info("dense attention: PyTorch's flash kernel (%s=flash)", DENSE_ENV)
    elif kernel is None:
        log.warning("dense attention: PyTorch's flash kernel, the compiled kernel is unavailable (see above)")
    elif setting == "compiled":
        log.info("dense attention: compiled kernel (%s=compiled)", DENSE_ENV)
    elif kernel.bf16_products:
        unit = "the tile unit" if kernel.tiles else "bfloat16 dot products"
        log.info("dense attention: compiled kernel for bfloat16 K/V (on %s) and float32 K/V, flash otherwise", unit)
    elif kernel.vector_bits == 512:
        log.info("dense attention: compiled kernel for float32 K/V, flash for bfloat16 (no AVX512-BF16 products)")
    elif kernel.vector_bits == 256:
        log.info("dense attention: compiled kernel on 256-bit vectors (AVX2) for bfloat16 and float32 K/V")
    else:
        log.info("dense attention: PyTorch's flash kernel (the CPU has no AVX2 or AVX-512 the compiled kernel uses)")
    return kernel


def _rounds(kernel: held_kernel.HeldKernel, q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the kernel takes these float32 queries over bfloat16 K/V with the casts folded in."""
    return (
        kernel.rounds_queries
        and q.dtype == torch.float32
        and keys.dtype == torch.bfloat16
        and not torch.compiler.is_compiling()
    )


def _auto_compiled(kernel: held_kernel.HeldKernel, dtype: torch.dtype, dim: int) -> bool:
    """Whether `auto` gives the kernel K/V of `dtype` (the queries meeting them there) with heads of `dim` values:
    bfloat16 ones it multiplies as bfloat16, float32 ones on its AVX-512 vector path (there it decoded and prefilled
    faster than PyTorch's flash kernel; for bfloat16 the vector path without bfloat16 products prefilled slower,
    docs/benchmarks.md), and both on its AVX2 path, heads of a multiple of 16 dimensions (on a CPU with AVX2 only, the
    default model decoded 1.16–1.40× as fast through the daemon and prefilled as fast, within noise;
    docs/benchmarks.md#dense-attention-through-the-compiled-kernel)."""
    if kernel.vector_bits == 256 and dtype in (torch.bfloat16, torch.float32):
        return dim % 16 == 0
    if dtype == torch.bfloat16:
        return kernel.bf16_products and dim % 32 == 0
    return kernel.vector_bits == 512 and dtype == torch.float32


def _attend_compiled(
    kernel: held_kernel.HeldKernel,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | str | None,
    groups: int,
    scale: float,
    memo: Memo,
    rounded: bool = False,
) -> torch.Tensor:
    """`attend_exact` through the compiled kernel (`HeldKernel.attend_dense`): every key tile whole and at fixed
    boundaries, every query row's arithmetic its own, so a query's values depend on the keys it reads alone. A block
    of more rows than the kernel takes at once is attended in parts of whole queries (which changes nothing).
    `rounded`: float32 queries over bfloat16 K/V, the casts in the kernel (`attend_exact`)."""
    batch, heads, n, dim = (int(s) for s in q.shape)
    hi, allowed = _memo_limits(memo, mask, n, int(keys.shape[2]))
    per = max(1, DENSE_ROWS // groups)
    threads = torch.get_num_threads()
    if n <= per and not torch.compiler.is_compiling():  # a decode step, a speculative block: one call
        out = kernel.attend_dense(q, keys, values, hi, allowed, scale, threads, with_lse=False, rounded=rounded)[0]
        return out.view(batch, heads, n, dim).to(q.dtype)
    outputs = []
    for start in range(0, n, per):
        end = min(n, start + per)
        part = (q[:, :, start:end], keys, values, hi[start:end], None if allowed is None else allowed[start:end])
        if torch.compiler.is_compiling():
            out = _dense_attention(*part, scale, threads)
        else:
            out = kernel.attend_dense(*part, scale, threads, with_lse=False, rounded=rounded)[0]
        outputs.append(out.view(batch, heads, end - start, dim))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.to(q.dtype)


def attend_exact_rows(
    q: torch.Tensor,
    rows: Sequence[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor | str | None]],
    groups: int,
    scale: float,
    memo: Memo,
) -> torch.Tensor | None:
    """`attend_exact` of each row `(start, end, keys, values, mask)` of a packed batched forward (its queries
    `[start, end)` of `q` `[1, H, T, D]`) over its own keys, in one call of the compiled kernel
    (`HeldKernel.attend_dense_rows`), where that kernel is what `attend_exact` would run for every row alone in one
    call: the output `[1, H, T, D]` holds each row's values alone, bit for bit, and the rows' work shares the
    threads (rows of different history lengths keep every thread busy, which one call per row does not). None
    where it is not (the caller attends row by row)."""
    kernel = dense_kernel()
    if kernel is None or not 2 <= len(rows) <= held_kernel.MAX_CALLS or torch.compiler.is_compiling():
        return None
    if (
        q.device.type != "cpu"
        or int(q.shape[3]) > held_kernel.MAX_DIM
        or len({keys.dtype for *_, keys, _, _ in rows}) != 1
        or sum(end - start for start, end, *_ in rows) != int(q.shape[2])  # the rows' spans fill the output
    ):
        return None
    dtype = rows[0][2].dtype
    rounded = _rounds(kernel, q, rows[0][2])  # the casts `attend_exact` makes, in the kernel
    read = q.to(dtype) if dtype != q.dtype and not rounded else q
    compiled = dense_setting() == "compiled"
    per = max(1, DENSE_ROWS // groups)
    if not (compiled or _auto_compiled(kernel, dtype, int(q.shape[3]))):
        return None
    calls = []
    for start, end, keys, values, mask in rows:
        if end - start > per:
            return None
        calls.append((start, end, keys, values, *_memo_limits(memo, mask, end - start, int(keys.shape[2]))))
    out = kernel.attend_dense_rows(read, calls, scale, torch.get_num_threads(), rounded=rounded)
    return out if rounded else out.to(read.dtype).to(q.dtype)


def _memo_limits(
    memo: Memo, mask: torch.Tensor | str | None, n: int, count: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_key_limits` of a mask, built once per forward (`memo`)."""
    key = ("compiled", mask if isinstance(mask, str) or mask is None else id(mask), n, count)
    limits = memo.get(key)
    if limits is None:
        limits = memo[key] = _key_limits(mask, n, count)
    return limits


@torch.library.custom_op("kakeya::dense_attention", mutates_args=())
def _dense_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    hi: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    threads: int,
) -> torch.Tensor:
    """`HeldKernel.attend_dense` as an operator a compiled graph calls (the same kernel, the same values)."""
    kernel = dense_kernel()
    if kernel is None:
        raise RuntimeError("the compiled attention kernel is not loaded")
    return kernel.attend_dense(q, keys, values, hi, allowed, scale, threads, with_lse=False)[0]


@_dense_attention.register_fake
def _(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    hi: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    threads: int,
) -> torch.Tensor:
    batch, heads, n, dim = q.shape
    kv_heads = keys.shape[1]
    return q.new_empty(batch, kv_heads, heads // kv_heads * n, dim, dtype=torch.float32)


def _key_limits(mask: torch.Tensor | str | None, n: int, count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What each of `n` queries reads of `count` keys, as the kernel takes it: the end of its keys (int64 `[n]`)
    and, for a mask tensor, which of them (uint8 `[n, count]`); None: every key before the end (a block over its
    history, each query reading every earlier key and itself)."""
    if isinstance(mask, torch.Tensor):
        plane = mask[0, 0]
        allowed = (plane if plane.dtype == torch.bool else plane == 0)[:, :count]
        reach = torch.arange(1, count + 1, dtype=torch.int64)
        hi = torch.where(allowed, reach, torch.zeros((), dtype=torch.int64)).amax(dim=1)
        return hi.contiguous(), allowed.to(torch.uint8).contiguous()
    return torch.arange(count - n + 1, count + 1, dtype=torch.int64), None


def _padded_mask(
    mask: torch.Tensor | str | None, n: int, count: int, groups: int, rows: int, length: int, dtype: torch.dtype
) -> torch.Tensor:
    """The additive mask `[1, 1, rows, length]` of `n` queries' grouped rows (each query's keys repeated per query
    head of a K/V head) over `count` keys padded to `length`. A padded row reads the first key, so that no softmax
    is empty."""
    if isinstance(mask, torch.Tensor):
        plane = mask[0, 0]
        allowed = plane if plane.dtype == torch.bool else plane == 0  # [n, count]
        additive = torch.full((rows, length), float("-inf"), dtype=dtype)
        additive[: groups * n, :count].masked_fill_(allowed.repeat(groups, 1), 0.0)
        additive[groups * n :, 0] = 0.0
        return additive[None, None]
    # OVER_HISTORY, or None (a block over itself alone, or one query): every earlier key, its own causally
    last = torch.zeros(rows, dtype=torch.long)  # the last key each row reads
    last[: groups * n] = (torch.arange(n) + (count - n)).repeat(groups)
    zero, hidden = torch.zeros((), dtype=dtype), torch.full((), float("-inf"), dtype=dtype)
    return torch.where(torch.arange(length)[None, :] <= last[:, None], zero, hidden)[None, None]


def joined(parts: list[torch.Tensor], padded: bool) -> torch.Tensor:
    """Dense parts `[B, H, c, D]` joined along the keys (a restored prefix and the resident keys, say); `padded`:
    into a buffer with zeroed room up to a whole `KEY_BLOCK`, so that `attend_exact` reads it without a second
    copy (`_with_room`)."""
    if not padded:
        return torch.cat(parts, dim=2)
    batch, heads, _, dim = parts[0].shape
    count = sum(int(part.shape[2]) for part in parts)
    buffer = parts[0].new_empty(batch, heads, count + (-count) % KEY_BLOCK, dim)
    start = 0
    for part in parts:
        buffer[:, :, start : start + part.shape[2]].copy_(part)
        start += int(part.shape[2])
    buffer[:, :, count:].zero_()
    return buffer[:, :, :count]


def _with_room(x: torch.Tensor, length: int) -> torch.Tensor:
    """`x` `[1, H, K, D]` read up to `length` keys: the view extended in place where the memory it is a view of
    goes on that far (a head's read runs into its own spare slots, the next head's slots, or the room a cache's
    buffers have after them: `ArrayOps.alloc_pair`), else padded with zeros. What lies beyond `K` is masked out, so
    only its finiteness matters: a cache's buffers are allocated zeroed, and every slot holds finite values."""
    batch, heads, count, dim = x.shape
    if length == count:
        return x
    stride = x.stride()
    end = x.storage_offset() + (heads - 1) * stride[1] + length * stride[2]
    fits = batch == 1 and stride[3] == 1 and stride[2] == dim and stride[1] >= count * dim
    if fits and end <= x.untyped_storage().nbytes() // x.element_size():
        return x.as_strided((batch, heads, length, dim), stride)
    return torch.cat([x, x.new_zeros(batch, heads, length - count, dim)], dim=2)
