"""The MLX verifier: one forward per block through mlx-lm's own model classes and its cache protocol."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kv_cache_proposer import sampling
from kv_cache_proposer.backends.mlx_backend.features import tap_layers
from kv_cache_proposer.backends.mlx_backend.kv_store import MlxSessionCache
from kv_cache_proposer.backends.mlx_backend.loader import LoadedModel, load_mlx_model, resolve_device, resolve_dtype
from kv_cache_proposer.errors import EngineError
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.strategies import KVStrategy
from kv_cache_proposer.verifier import VerifyOutput

# Below this many K/V-only positions a second model call costs more than the rows it saves (measured on the tiny
# test models on a CPU, where the crossover lies between 64 and 128; larger vocabularies save more per row).
_KV_ONLY_MIN_TOKENS = 64


class MlxVerifier:
    """An mlx-lm causal LM serving per-session caches.

    Every call evaluates what it produced (logits and K/V) before it returns, so neither the cache nor the caller
    holds a lazy graph across calls, and the arrays can be read from any thread.
    """

    def __init__(self, loaded: LoadedModel, *, device: mx.Device) -> None:
        self.model: nn.Module = loaded.model
        self.device = device
        self.dtype = loaded.dtype
        self._model_type = loaded.model_type
        self._vocab_size = loaded.vocab_size
        self._num_layers = loaded.num_layers
        self._layer_windows = loaded.layer_windows
        self._hidden_size = loaded.hidden_size

    @classmethod
    def load(cls, model_dir: str | Path, *, device: str = "auto", dtype: str = "auto") -> MlxVerifier:
        mlx_device = resolve_device(device)
        loaded = load_mlx_model(model_dir, resolve_dtype(dtype, mlx_device))
        return cls(loaded, device=mlx_device)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def hidden_size(self) -> int:
        return self._hidden_size

    @property
    def description(self) -> str:
        device = "gpu" if self.device.type == mx.gpu else "cpu"
        dtype = str(self.dtype).removeprefix("mlx.core.")
        return f"mlx {self._model_type} ({self._num_layers} layers) on {device} {dtype}"

    def new_cache(self, strategy: KVStrategy) -> MlxSessionCache:
        return MlxSessionCache(strategy, layer_windows=self._layer_windows)

    def verify(
        self,
        cache: MlxSessionCache,
        token_ids: Sequence[int],
        logits_rows: int,
        *,
        feature_layers: Sequence[int] = (),
        extend_stage: bool = False,
    ) -> VerifyOutput:
        block_len = len(token_ids)
        # Positions before the logits rows only need their K/V: a separate model call for them is never asked for
        # its last layer's output or its LM head rows, as in mlx-lm's own prefill.
        head = block_len - logits_rows if block_len - logits_rows >= _KV_ONLY_MIN_TOKENS else 0
        taps = tap_layers(self.model, feature_layers) if feature_layers else []
        for tap in taps:
            tap.recording.outputs = []
        try:
            with mx.stream(self.device):
                input_ids = mx.array([list(token_ids)], dtype=mx.int32)  # [1, n]
                layers = cache.begin_stage(block_len, extend=extend_stage)
                base = cache.block_start
                if head:
                    cache.select_queries(base, base + head)
                    self.model(input_ids[:, :head], cache=layers)  # outputs never evaluated
                    cache.select_queries(base + head, base + block_len)
                logits = self.model(input_ids[:, head:], cache=layers)  # [1, n - head, V]
                rows = logits[0, -logits_rows:].astype(mx.float32)  # [rows, V]
                features = None
                if taps:
                    # Each tap saw the block in one or two model calls: [1, part, H] each.
                    parts = [mx.concatenate(tap.recording.outputs or [], axis=1)[0] for tap in taps]
                    features = mx.concatenate(parts, axis=-1)  # [n, L*H]
                    mx.eval(rows, features, cache.staged_arrays())
                else:
                    mx.eval(rows, cache.staged_arrays())
        finally:
            for tap in taps:
                tap.recording.outputs = None
        return VerifyOutput(rows, features)

    def embed_tokens(self, token_ids: mx.array) -> mx.array:
        """The model's input embeddings of token ids [B, T] -> [B, T, H] (before any model-specific scaling)."""
        return self._inner().embed_tokens(token_ids)

    def lm_head(self, hidden: mx.array) -> mx.array:
        """Logits [..., V] of final hidden states [..., H] through the model's own LM head."""
        head = getattr(self.model, "lm_head", None)
        return head(hidden) if head is not None else self._inner().embed_tokens.as_linear(hidden)

    def _inner(self) -> nn.Module:
        inner = getattr(self.model, "model", None) or getattr(self.model, "language_model", None)
        if inner is None or not hasattr(inner, "embed_tokens"):
            raise EngineError(f"cannot find the input embeddings of this {self._model_type} model")
        return inner

    def commit(self, cache: MlxSessionCache, count: int) -> None:
        with mx.stream(self.device):
            cache.commit(count)

    def pick_tokens(self, logits: mx.array, params: SamplingParams, positions: Sequence[int]) -> list[int]:
        return sampling.pick_tokens(self.host_logits(logits), params, positions)

    def host_logits(self, logits: mx.array) -> np.ndarray:
        return np.array(logits, dtype=np.float64)
