"""Attention over keys and values that arrive in chunks, merged by their log-sum-exps: the result of attending the
chunks' keys concatenated, within float rounding, while only one chunk's K/V and scores exist at a time (a history
held compactly is read one chunk at a time).

Queries are handled grouped: `[B, H_kv, g·n, D]`, the `g` query heads of each K/V head one after another, so a
grouped K/V head is never repeated. A chunk's contribution is a `Partial`: its softmax-weighted values and their
log-sum-exp, which `merge` combines exactly as one softmax over both chunks' keys would.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kv_cache_proposer.cache.protocol import KeyPart

flash_cpu: Any = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (output, log-sum-exp)

Chunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""Keys and values `[B, H_kv, c, D]` and which of them each query may read, `[n, c]` booleans (None: all)."""

Partial = tuple[torch.Tensor, torch.Tensor]
"""Attention over some of the keys: output `[B, H_kv, g·n, D]` and log-sum-exp `[B, H_kv, g·n, 1]`, float32 (a
query that may read none of them has zeros and −inf)."""


def grouped_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Queries `[B, H, n, D]` as `[B, H_kv, g·n, D]` float32."""
    batch, heads, n, dim = q.shape
    return q.reshape(batch, kv_heads, (heads // kv_heads) * n, dim).float()


def masked(scores: torch.Tensor, allowed: torch.Tensor | None, groups: int) -> torch.Tensor:
    """Scores `[B, H_kv, g·n, c]` with the keys a query may not read at −inf (`allowed` `[n, c]`, None: all)."""
    if allowed is None:
        return scores
    return scores.masked_fill_(~allowed.repeat(groups, 1), float("-inf"))


def softmax_parts(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised softmax weights of `scores` `[..., c]` (in place), their sums and the log-sum-exps `[..., 1]`.
    A row with no readable key has weights and sum 0 and log-sum-exp −inf."""
    top = scores.amax(dim=-1, keepdim=True)
    top = top.masked_fill(torch.isinf(top), 0.0)
    weights = scores.sub_(top).exp_()
    sums = weights.sum(dim=-1, keepdim=True)
    return weights, sums, top + torch.log(sums)


def dense_partial(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor | None, *, scale: float
) -> Partial:
    """Attention of the queries `[B, H, n, D]` over dense keys and values `[B, H_kv, c, D]`."""
    kv_heads = int(keys.shape[1])
    scores = grouped_queries(q, kv_heads) @ keys.float().transpose(-1, -2) * scale
    weights, sums, lse = softmax_parts(masked(scores, allowed, int(q.shape[1]) // kv_heads))
    return (weights @ values.float()) / sums.clamp_min(torch.finfo(torch.float32).tiny), lse


def flash_partial(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor | None, *, scale: float
) -> Partial:
    """`dense_partial` by PyTorch's CPU flash kernel (blocks of keys under a running softmax, on every thread): the
    same values within float rounding, without the block's whole score matrix; `dense_partial` off the CPU."""
    if q.device.type != "cpu":
        return dense_partial(q, keys, values, allowed, scale=scale)
    kv_heads = int(keys.shape[1])
    grouped = grouped_queries(q, kv_heads)  # [B, H_kv, g·n, D]: a grouped K/V head is read once
    if allowed is None:
        out, lse = flash_cpu(grouped, keys.float(), values.float(), scale=scale)
        return out, lse.unsqueeze(-1)
    rows = allowed.repeat(int(q.shape[1]) // kv_heads, 1)  # [g·n, c]
    mask = torch.zeros(rows.shape, dtype=torch.float32).masked_fill_(~rows, float("-inf"))[None, None]
    out, lse = flash_cpu(grouped, keys.float(), values.float(), attn_mask=mask, scale=scale)
    # The kernel gives a row that may read none of the keys zeros and a log-sum-exp of 0; a `Partial` has −inf.
    none = ~rows.any(dim=-1)[:, None]  # [g·n, 1]
    return out, lse.unsqueeze(-1).masked_fill(none, float("-inf"))


def merge(a: Partial | None, b: Partial) -> Partial:
    """Two chunks' attention as one softmax over both chunks' keys."""
    if a is None:
        return b
    (out, lse), (part, part_lse) = a, b
    top = torch.maximum(lse, part_lse)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # rows with no key in either part
    kept, added = torch.exp(lse - top), torch.exp(part_lse - top)
    total = kept + added
    merged = torch.where(total > 0, (out * kept + part * added) / total.clamp_min(torch.finfo(total.dtype).tiny), out)
    return merged, top + torch.log(total)


def attend_chunks(q: torch.Tensor, chunks: Iterable[Chunk], *, scale: float) -> torch.Tensor:
    """Attention of the queries `[B, H, n, D]` over every chunk's keys (`H` a multiple of each chunk's `H_kv`: the
    query heads of a K/V head are consecutive), computed in float32 and returned in the queries' dtype. A query
    that may read no key at all gets zeros."""
    batch, heads, n, dim = q.shape
    merged: Partial | None = None
    for keys, values, allowed in chunks:
        merged = merge(merged, dense_partial(q, keys, values, allowed, scale=scale))
    if merged is None:
        raise ValueError("attention needs at least one chunk of keys")
    return merged[0].reshape(batch, heads, n, dim).to(q.dtype)


def attend_parts(
    q: torch.Tensor, parts: Sequence[KeyPart[torch.Tensor]], allowed: torch.Tensor | None, *, scale: float
) -> torch.Tensor:
    """Attention of the queries `[B, H, n, D]` over the keys of `parts` in order (`allowed` `[n, K]` over all of
    them, None: every key), part by part: a dense part in one piece, a held part through its own `attend` (which
    reads it chunk by chunk, with the dense part after it). Float32 inside, returned in the queries' dtype."""
    batch, heads, n, dim = q.shape
    merged: Partial | None = None
    start = index = 0
    while index < len(parts):
        part = parts[index]
        if isinstance(part, tuple):
            count = int(part[0].shape[2])
            columns = None if allowed is None else allowed[:, start : start + count]
            result = dense_partial(q, part[0], part[1], columns, scale=scale)
        else:  # a held part reads the dense part after it (the stage) in the same pass
            following = parts[index + 1] if index + 1 < len(parts) else None
            tail = following if isinstance(following, tuple) else None
            count = part.length + (0 if tail is None else int(tail[0].shape[2]))
            columns = None if allowed is None else allowed[:, start : start + count]
            result = part.attend(q, columns, scale, tail)  # type: ignore[attr-defined]
            index += tail is not None
        merged = merge(merged, result)
        start += count
        index += 1
    if merged is None:
        raise ValueError("attention needs at least one part of keys")
    return merged[0].reshape(batch, heads, n, dim).to(q.dtype)
