"""KV compression (SPEC §6.6): resident K/V held as packed KakeyaLattice codes, on every backend."""

from kv_cache_proposer.compression.codec import LatticeCodec, LatticeCoding
from kv_cache_proposer.compression.compressor import (
    COMPRESSORS,
    DEFAULT_Q_RANGE,
    KVCompressor,
    compressor_layer_store,
)
from kv_cache_proposer.compression.lattice import MAX_Q_RANGE, LatticeSpec
from kv_cache_proposer.compression.packed_store import PackedLayerStore

__all__ = [
    "COMPRESSORS",
    "DEFAULT_Q_RANGE",
    "MAX_Q_RANGE",
    "KVCompressor",
    "LatticeCodec",
    "LatticeCoding",
    "LatticeSpec",
    "PackedLayerStore",
    "compressor_layer_store",
]
