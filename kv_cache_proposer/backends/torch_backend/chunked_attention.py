"""Attention over keys and values that arrive in chunks, merged by their log-sum-exps: the result of attending the
chunks' keys concatenated, within float rounding, while only one chunk's K/V and scores exist at a time (a history
held compactly is read one chunk at a time)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

Chunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""Keys and values `[B, H_kv, c, D]` and which of them each query may read, `[n, c]` booleans (None: all)."""


def attend_chunks(q: torch.Tensor, chunks: Iterable[Chunk], *, scale: float) -> torch.Tensor:
    """Attention of the queries `[B, H, n, D]` over every chunk's keys (`H` a multiple of each chunk's `H_kv`: the
    query heads of a K/V head are consecutive), computed in float32 and returned in the queries' dtype. A query
    that may read no key at all gets zeros."""
    batch, heads, n, dim = q.shape
    out: torch.Tensor | None = None  # [B, H_kv, g·n, D]: the merged output so far
    lse: torch.Tensor | None = None  # [B, H_kv, g·n, 1]: its log-sum-exp
    for keys, values, allowed in chunks:
        kv_heads = keys.shape[1]
        groups = heads // kv_heads
        grouped = q.reshape(batch, kv_heads, groups * n, dim).float()
        scores = grouped @ keys.float().transpose(-1, -2) * scale  # [B, H_kv, g·n, c]
        if allowed is not None:
            scores = scores.masked_fill(~allowed.repeat(groups, 1), float("-inf"))
        part_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        part = torch.exp(scores - part_lse).nan_to_num(0.0) @ values.float()  # a row with no key: zeros
        if out is None or lse is None:
            out, lse = part, part_lse
            continue
        top = torch.maximum(lse, part_lse)
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # rows with no key in either part
        kept, added = torch.exp(lse - top), torch.exp(part_lse - top)
        total = kept + added
        out = torch.where(total > 0, (out * kept + part * added) / total.clamp_min(torch.finfo(total.dtype).tiny), out)
        lse = top + torch.log(total)
    if out is None:
        raise ValueError("attention needs at least one chunk of keys")
    return out.reshape(batch, heads, n, dim).to(q.dtype)
