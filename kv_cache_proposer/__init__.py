"""Kakeya's tensor engine: verifier backends, per-session KV caches and strategies, the speculative decode loop.

This package never imports `inference_engine`; the daemon drives it through `Verifier`, `SessionCache`,
`Proposer` and `Decoder`.
"""

from kv_cache_proposer.decoding import Decoder, GenerationBudget, SequenceState, StepResult
from kv_cache_proposer.errors import EngineError, InvariantViolation, ModelLoadError
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import FullStrategy, KVStrategy, SinkWindowStrategy

__all__ = [
    "Decoder",
    "EngineError",
    "FullStrategy",
    "GenerationBudget",
    "InvariantViolation",
    "KVStrategy",
    "ModelLoadError",
    "SamplingParams",
    "SequenceState",
    "SinkWindowStrategy",
    "StepResult",
]
