"""The model interfaces every backend implements: a causal LM that runs blocks over session caches, and the
verifier (the served model), which can also hand out its hidden states."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol

import numpy as np

from kv_cache_proposer.cache.arrays import A
from kv_cache_proposer.cache.layer_store import LayerStoreFactory
from kv_cache_proposer.cache.protocol import SessionCache
from kv_cache_proposer.restoration.setup import RestorationSetup
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import KVStrategy

__all__ = ["BatchBlock", "CausalLM", "SessionCache", "Verifier", "VerifyOutput"]


@dataclass(frozen=True, slots=True)
class VerifyOutput(Generic[A]):
    """What one forward returns (backend arrays)."""

    logits: A  # [rows, vocab]: the last `logits_rows` block positions
    features: A | None = None  # [block, len(layers) * hidden]: hidden states at the requested layers


@dataclass(frozen=True, slots=True)
class BatchBlock(Generic[A]):
    """One row of a batched forward: a block of tokens at the next positions of `cache`."""

    cache: SessionCache[A]
    token_ids: Sequence[int]
    logits_rows: int  # logits wanted for the last this-many block positions


class CausalLM(Protocol[A]):
    """A loaded autoregressive model that runs blocks of tokens over per-session caches (a verifier, or a draft
    model loaded by the same backend)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def prefill_chunk_tokens(self) -> int:
        """Pending tokens one prefill forward takes by default on this model's device."""
        ...

    def new_cache(
        self,
        strategy: KVStrategy,
        *,
        layer_store: LayerStoreFactory[A] | None = None,
        restoration: RestorationSetup | None = None,
    ) -> SessionCache[A]:
        """A session cache under `strategy`; `layer_store` chooses what each layer stores (dense by default) and
        `restoration` how a `dlm_restore` cache restores evicted positions (default: `recompute` every layer)."""
        ...

    def verify(
        self,
        cache: SessionCache[A],
        token_ids: Sequence[int],
        logits_rows: int,
        *,
        feature_layers: Sequence[int] = (),
        extend_stage: bool = False,
    ) -> VerifyOutput[A]:
        """Run one forward over `token_ids` at the cache's next positions, staging their K/V.

        Returns the logits of the last `logits_rows` block positions and, when `feature_layers` is given, the
        outputs of those decoder layers for every block position, concatenated along the hidden dimension.
        Nothing becomes resident until `commit`. With `extend_stage` the block continues the stage of the
        previous forward (it sits after it and attends to it) instead of replacing it.
        """
        ...

    def commit(self, cache: SessionCache[A], count: int) -> None:
        """Make the first `count` staged positions resident, drop the rest of the stage and evict per strategy.

        Raises `InvariantViolation` when the cache's bookkeeping and its stored K/V disagree afterwards.
        """
        ...

    def pick_tokens(self, logits: A, params: SamplingParams, positions: Sequence[int]) -> list[int]:
        """Choose one token per logits row; row i samples the token at global position `positions[i]`."""
        ...

    def host_logits(self, logits: A) -> np.ndarray:
        """A float64 host copy [rows, vocab] of logits rows, for the controls that reshape them (controls.py)."""
        ...


class Verifier(CausalLM[A], Protocol[A]):
    """The served model: a causal LM whose size and hidden states proposers may use."""

    @property
    def decode_burst_tokens(self) -> int:
        """How many plain greedy decode steps `burst` runs by default on this model's device."""
        ...

    @property
    def batch_size(self) -> int:
        """How many concurrent sessions' steps one forward runs by default on this backend."""
        ...

    def burst(
        self, cache: SessionCache[A], token_ids: Sequence[int], steps: int, feature_layers: Sequence[int] = ()
    ) -> tuple[list[int], A | None]:
        """Stage `token_ids` at the cache's next positions and decode `steps` greedy tokens in a row: the forward
        over the block picks the first, and each later forward takes the previous pick as its input, on the
        device, so no step waits for the host. Returns the picks and, with `feature_layers`, the features
        [len(token_ids) + steps - 1, L*H] of every staged position (as `verify` of the block and the picks but
        the last would return them; else None). The staged K/V of the block and of every pick but the last stay
        staged until `commit` (which may keep fewer, as after any speculative step); the cache is told their token
        ids (`name_stage`) before the burst returns."""
        ...

    def verify_batch(
        self, blocks: Sequence[BatchBlock[A]], *, feature_layers: Sequence[int] = ()
    ) -> list[VerifyOutput[A]]:
        """`verify` of several sessions' blocks (one per cache) in one forward; returns one output per block, in
        order. Each block sees only its own cache, strategy, positions and mask, as if it ran alone."""
        ...

    @property
    def description(self) -> str:
        """Human-readable summary: backend, model type, device, dtype."""
        ...

    def kv_from_host(self, array: np.ndarray) -> A:
        """A host array `[B, H, n, D]` as K/V of this model: in its K/V dtype, on its device."""
        ...

    @property
    def reads_held_keys(self) -> bool:
        """Whether this model's attention reads keys held compactly (`HeldKeys`) part by part; otherwise a packed
        session keeps its residents decoded while it generates (`compressor_layer_store(held=...)`)."""
        ...

    @property
    def num_layers(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...
