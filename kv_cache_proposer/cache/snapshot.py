"""Copies of a session cache, apart from the contract a forward uses (`SessionCache`): what a fork starts from."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kv_cache_proposer.cache.arrays import A
from kv_cache_proposer.cache.protocol import SessionCache


@runtime_checkable
class Cloneable(Protocol[A]):
    def clone(self, length: int) -> SessionCache[A]:
        """An independent cache holding what this one would hold had it committed only `length` positions.

        Raises `ValueError` when positions the copy needs were already evicted here.
        """
        ...


def clone_cache(cache: SessionCache[A], length: int) -> SessionCache[A]:
    """An independent copy of `cache` as it was after `length` committed positions (`Cloneable.clone`); raises
    `ValueError` when positions the copy needs were already evicted, `TypeError` for a cache that cannot be
    copied."""
    if not isinstance(cache, Cloneable):
        raise TypeError(f"a {type(cache).__name__} cannot be copied")
    copy: SessionCache[A] = cache.clone(length)
    return copy
