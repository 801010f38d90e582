"""The verifier interface every backend implements, and the per-session cache it creates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import KVStrategy


@dataclass(frozen=True, slots=True)
class VerifyOutput:
    """What one verifier forward returns (backend arrays)."""

    logits: Any  # [rows, vocab]: the last `logits_rows` block positions
    features: Any | None = None  # [block, len(layers) * hidden]: hidden states at the requested layers


class SessionCache(Protocol):
    """One session's verifier K/V, held under a KV strategy.

    A forward stages the K/V of its block; `Verifier.commit` makes a prefix of them resident and discards the
    rest, so rejected draft K/V never reach the resident cache.
    """

    @property
    def strategy(self) -> KVStrategy: ...

    @property
    def next_position(self) -> int:
        """Global position of the next committed token (= number of committed positions)."""
        ...

    @property
    def resident_count(self) -> int:
        """Positions whose K/V are resident."""
        ...

    @property
    def evicted_count(self) -> int:
        """Committed positions no longer resident."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage the cache holds now."""
        ...

    @property
    def compressed_bytes(self) -> int:
        """Bytes of compressed K/V payload (0 for an uncompressed cache)."""
        ...

    def release(self) -> None:
        """Free the storage. The cache must not be used afterwards."""
        ...


class Verifier(Protocol):
    """A loaded autoregressive model that checks blocks of tokens against per-session caches."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def description(self) -> str:
        """Human-readable summary: backend, model type, device, dtype."""
        ...

    def new_cache(self, strategy: KVStrategy) -> SessionCache: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    def verify(
        self,
        cache: Any,
        token_ids: Sequence[int],
        logits_rows: int,
        *,
        feature_layers: Sequence[int] = (),
        extend_stage: bool = False,
    ) -> VerifyOutput:
        """Run one forward over `token_ids` at the cache's next positions, staging their K/V.

        Returns the logits of the last `logits_rows` block positions and, when `feature_layers` is given, the
        outputs of those decoder layers for every block position, concatenated along the hidden dimension.
        Nothing becomes resident until `commit`. With `extend_stage` the block continues the stage of the
        previous forward (it sits after it and attends to it) instead of replacing it.
        """
        ...

    def commit(self, cache: Any, count: int) -> None:
        """Make the first `count` staged positions resident, drop the rest of the stage and evict per strategy.

        Raises `InvariantViolation` when the cache's bookkeeping and its stored K/V disagree afterwards.
        """
        ...

    def pick_tokens(self, logits: Any, params: SamplingParams, positions: Sequence[int]) -> list[int]:
        """Choose one token per logits row; row i samples the token at global position `positions[i]`."""
        ...

    def host_logits(self, logits: Any) -> np.ndarray:
        """A float64 host copy [rows, vocab] of logits rows, for the controls that reshape them (controls.py)."""
        ...
