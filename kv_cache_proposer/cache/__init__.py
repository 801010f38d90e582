"""Per-session K/V caches, written once for every backend over a small array seam."""

from kv_cache_proposer.cache.arrays import ArrayOps
from kv_cache_proposer.cache.layer_store import CommitPlan, DenseLayerStore, LayerStore, LayerStoreFactory
from kv_cache_proposer.cache.masks import visible_keys
from kv_cache_proposer.cache.protocol import AttentionPrefix, SessionCache
from kv_cache_proposer.cache.session import KVSessionCache

__all__ = [
    "ArrayOps",
    "AttentionPrefix",
    "CommitPlan",
    "DenseLayerStore",
    "KVSessionCache",
    "LayerStore",
    "LayerStoreFactory",
    "SessionCache",
    "visible_keys",
]
