"""Forking a session's sequence: the fork's history is a prefix of the parent's, and its caches start as copies.

Policy: the fork keeps its last history token pending (as every session does after a generation), so its caches are
cloned at `min(parent committed, prefix - 1)` positions and its next generation prefills only what follows. When a
bounded cache already evicted positions that prefix needs, nothing is copied and the fork's next generation
re-prefills its whole history: slower, but the same tokens.
"""

from __future__ import annotations

from kv_cache_proposer.cache.snapshot import clone_cache
from kv_cache_proposer.decoding import SequenceState


def fork_sequence(seq: SequenceState, length: int) -> SequenceState:
    """An independent sequence holding `seq`'s first `length` tokens. Runs on the engine thread (it copies K/V)."""
    if not 0 <= length <= len(seq.tokens):
        raise ValueError(f"cannot fork {length} tokens of a history of {len(seq.tokens)}")
    keep = min(seq.committed, max(length - 1, 0))
    try:
        cache = clone_cache(seq.cache, keep)
    except ValueError:
        keep, cache = 0, clone_cache(seq.cache, 0)
    return SequenceState(
        cache=cache, tokens=list(seq.tokens[:length]), draft_session=seq.draft_session.clone(keep), committed=keep
    )
