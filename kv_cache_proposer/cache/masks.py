"""The one attention-mask builder: which keys each query may read, from global positions alone."""

from __future__ import annotations

import numpy as np

from kv_cache_proposer.strategies import KVStrategy


def visible_keys(
    strategy: KVStrategy,
    query_positions: np.ndarray,
    key_positions: np.ndarray,
    *,
    causal: bool = True,
    window: int | None = None,
    own_keys: int = 0,
) -> np.ndarray:
    """Boolean `[n, K]`: whether the query at `query_positions[i]` may read the key at `key_positions[j]`.

    A key position below zero is an empty slot. `causal` hides keys after the query (a drafter's block reads
    both ways); `window` hides keys `window` or more positions away (a sliding-window layer). The last `own_keys`
    keys are the queries' own K/V as computed (`ModelCall.own_keys`): each query reads its own there, and the
    same position's other key only from later queries.
    """
    q = query_positions[:, None]  # [n, 1]
    k = key_positions[None, :]  # [1, K]
    allowed = (q >= 0) & (k >= 0) & strategy.visible(q, k)  # [n, K]
    if causal:
        allowed = allowed & (k <= q)
    if window is not None:
        allowed = allowed & (np.abs(q - k) < window)
    if own_keys:
        body = key_positions.size - own_keys
        allowed[:, :body] &= k[:, :body] != q
        allowed[:, body:] &= k[:, body:] == q
    return allowed
