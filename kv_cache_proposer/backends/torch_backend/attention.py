"""Handing a session cache to transformers' attention: one `Cache` per forward whose layers stage into it."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kv_cache_proposer.backends.batching import BatchLayout
from kv_cache_proposer.cache.protocol import ModelCall, SessionCache


class _StagingLayer(CacheLayerMixin):
    """transformers cache layer that stages a forward's K/V in a session cache and returns what attention reads."""

    is_sliding = False

    def __init__(self, cache: SessionCache[torch.Tensor] | BatchLayout[torch.Tensor], layer_idx: int) -> None:
        super().__init__()
        self._cache = cache
        self._layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cache.stage_layer(self._layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        counts = self._key_counts()
        return counts.keys_before_queries + query_length + counts.own_keys, 0

    def get_seq_length(self) -> int:
        return self._key_counts().keys_before_queries

    def _key_counts(self) -> ModelCall | BatchLayout[torch.Tensor]:
        """Where the keys of the model call in flight stand around its queries."""
        return self._cache if isinstance(self._cache, BatchLayout) else self._cache.call

    def get_max_length(self) -> int:
        return -1


class StagingCache(Cache):
    """The `past_key_values` object of one forward: routes every layer's update into the session cache (or, for a
    batched forward, into each row's session cache through the batch layout)."""

    def __init__(self, cache: SessionCache[torch.Tensor] | BatchLayout[torch.Tensor]) -> None:
        super().__init__(layers=[_StagingLayer(cache, i) for i in range(cache.num_layers)])
