"""Sessions over packed layer stores for the compression tests: the strategies and compressors they run, prompts,
generation through the decoder and what a cache holds, read back."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from kv_cache_proposer.compression import KVCompressor, compressor_layer_store
from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.proposers.ngram import NgramProposer
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy, SinkWindowStrategy
from tests.support.backends import to_numpy
from tests.support.checkpoints import VOCAB_SIZE

STRATEGIES = [FullStrategy(), SinkWindowStrategy(sink=2, window=10)]
STRATEGY_IDS = ["full", "sink"]
COMPRESSORS = [KVCompressor("kakeya_d4", 38), KVCompressor("kakeya_e8", 10), KVCompressor("kakeya_d4s", 10)]
COMPRESSOR_IDS = ["d4", "e8", "d4s"]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def packed_cache(verifier: Any, backend: str, strategy: Any, compressor: KVCompressor) -> Any:
    return verifier.new_cache(strategy, layer_store=compressor_layer_store(backend, compressor))


def generate(
    verifier: Any, cache: Any, prompt: list[int], new_tokens: int, *, speculate: bool = False, chunk: int = 7
) -> list[int]:
    draft = NgramProposer().open(cache.strategy) if speculate else None
    seq = SequenceState(cache=cache, tokens=list(prompt), **({"draft_session": draft} if draft else {}))
    decoder = Decoder(verifier, prefill_chunk_tokens=chunk)
    budget = GenerationBudget(max_new_tokens=new_tokens)
    generated: list[int] = []
    while len(generated) < new_tokens:
        generated += decoder.step(seq, SamplingParams(), budget, len(generated)).tokens
    return generated[:new_tokens]


def resident(cache: Any) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    out = []
    for layer in range(cache.num_layers):
        keys, values, positions = cache.resident_kv(layer)
        out.append((to_numpy(keys), to_numpy(values), positions))
    return out


def layer_bytes(cache: Any) -> int:
    return sum(layer.nbytes for layer in cache._layers)
