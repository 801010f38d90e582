"""Short decodes through every strategy and proposer, to compare two ways of serving one model token for token."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState
from kv_cache_proposer.proposers import ProposerOptions, load_proposer
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import DlmRestoreStrategy, FullStrategy, KVStrategy, SinkWindowStrategy
from tests.support.checkpoints import VOCAB_SIZE, save_dflash_drafter, save_draft_model

PROPOSERS = ("none", "ngram", "draft_model", "dflash")
DECODE_STRATEGIES: dict[str, KVStrategy] = {
    "full": FullStrategy(),
    "sink": SinkWindowStrategy(sink=2, window=8),
    "dlm_restore": DlmRestoreStrategy(sink=2, window=8),
}
# Greedy, and seeded sampling.
SAMPLINGS = (SamplingParams(), SamplingParams(temperature=0.8, seed=7))

# Ways to deliver 1,100 tokens: one block, prefill chunks of several sizes, mixed blocks, and token by token.
DELIVERIES = {
    "one block": [1100],
    "chunks of 512": [512, 512, 76],
    "chunks of 300": [300, 300, 300, 200],
    "mixed": [7, 1, 64, 3, 513, 1, 1, 5, 400, 105],
    "token by token": [1] * 1100,
}

# Strategies whose caches hold the history in other layouts: a ring that wraps at a position no key block of 512
# starts at, and the same ring behind the restored K/V of every evicted position.
BOUNDED = {"sink_window": SinkWindowStrategy(sink=4, window=600), "dlm_restore": DlmRestoreStrategy(sink=4, window=600)}


def random_tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def proposer_options(name: str, root: Path) -> ProposerOptions:
    """Options of proposer `name` drafting 3 tokens; draft models are saved under `root`."""
    drafts = {"draft_model": save_draft_model(root / "draft"), "dflash": save_dflash_drafter(root / "dflash")}
    return ProposerOptions(name=name, draft_model=drafts.get(name), num_draft_tokens=3)


def decode(
    verifier: Any, backend: str, strategy: KVStrategy, options: ProposerOptions, params: SamplingParams
) -> list[int]:
    """24 tokens after a fixed 20-token prompt, with the proposer of `options` loaded for `verifier`."""
    proposer = load_proposer(options, verifier, backend=backend, device="cpu", dtype="float32")
    seq = SequenceState(
        cache=verifier.new_cache(strategy), tokens=random_tokens(4, 20), draft_session=proposer.open(strategy)
    )
    decoder, produced = Decoder(verifier), []
    while len(produced) < 24:
        produced += decoder.step(seq, params, GenerationBudget(24), len(produced)).tokens
    seq.draft_session.release()
    return produced


def delivered_values(verifier: Any, strategy: KVStrategy, sizes: list[int]) -> tuple[Any, Any, Any, Any]:
    """A 1,100-token history delivered to a fresh cache in blocks of `sizes`, then a 5-token block verified: its
    logits and the features of the first and last layers, and the last layer's resident K/V."""
    history, block = random_tokens(1, sum(sizes)), random_tokens(2, 5)
    cache = verifier.new_cache(strategy)
    start = 0
    for size in sizes:
        verifier.verify(cache, history[start : start + size], 1)
        verifier.commit(cache, size)
        start += size
    out = verifier.verify(cache, block, len(block), feature_layers=(0, verifier.num_layers - 1))
    keys, values, _ = cache.resident_kv(verifier.num_layers - 1)
    return out.logits, out.features, keys, values
