"""Attention over keys and values that arrive in chunks, merged by their log-sum-exps: the result of attending the
chunks' keys concatenated, within float rounding, while only one chunk's K/V and scores exist at a time (a history
held compactly is read one chunk at a time)."""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx

Chunk = tuple[mx.array, mx.array, mx.array | None]
"""Keys and values `[B, H_kv, c, D]` and which of them each query may read, `[n, c]` booleans (None: all)."""


def attend_chunks(q: mx.array, chunks: Iterable[Chunk], *, scale: float) -> mx.array:
    """Attention of the queries `[B, H, n, D]` over every chunk's keys (`H` a multiple of each chunk's `H_kv`: the
    query heads of a K/V head are consecutive), computed in float32 and returned in the queries' dtype. A query
    that may read no key at all gets zeros."""
    batch, heads, n, dim = q.shape
    out: mx.array | None = None  # [B, H_kv, g·n, D]: the merged output so far
    lse: mx.array | None = None  # [B, H_kv, g·n, 1]: its log-sum-exp
    for keys, values, allowed in chunks:
        kv_heads = keys.shape[1]
        groups = heads // kv_heads
        grouped = q.reshape(batch, kv_heads, groups * n, dim).astype(mx.float32)
        scores = (grouped @ keys.astype(mx.float32).swapaxes(-1, -2)) * scale  # [B, H_kv, g·n, c]
        if allowed is not None:
            scores = mx.where(mx.tile(allowed, (groups, 1)), scores, -mx.inf)
        part_lse = mx.logsumexp(scores, axis=-1, keepdims=True)
        weights = mx.exp(scores - part_lse)
        part = mx.where(mx.isnan(weights), 0.0, weights) @ values.astype(mx.float32)  # a row with no key: zeros
        if out is None or lse is None:
            out, lse = part, part_lse
            continue
        top = mx.maximum(lse, part_lse)
        top = mx.where(mx.isinf(top), 0.0, top)  # rows with no key in either part
        kept, added = mx.exp(lse - top), mx.exp(part_lse - top)
        total = kept + added
        out = mx.where(total > 0, (out * kept + part * added) / mx.maximum(total, 1e-30), out)
        lse = top + mx.log(total)
    if out is None:
        raise ValueError("attention needs at least one chunk of keys")
    return out.reshape(batch, heads, n, dim).astype(q.dtype)
