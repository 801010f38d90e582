"""The MLX verifier: one forward per block through mlx-lm's own model classes and its cache protocol."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kv_cache_proposer import sampling
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
        if feature_layers:
            raise EngineError("the mlx backend does not capture layer features (the dflash proposer needs torch)")
        block_len = len(token_ids)
        # Positions before the logits rows only need their K/V: a separate model call for them is never asked for
        # its last layer's output or its LM head rows, as in mlx-lm's own prefill.
        head = block_len - logits_rows if block_len - logits_rows >= _KV_ONLY_MIN_TOKENS else 0
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
            mx.eval(rows, cache.staged_arrays())
        return VerifyOutput(rows)

    def commit(self, cache: MlxSessionCache, count: int) -> None:
        with mx.stream(self.device):
            cache.commit(count)

    def pick_tokens(self, logits: mx.array, params: SamplingParams, positions: Sequence[int]) -> list[int]:
        return sampling.pick_tokens(np.array(logits, dtype=np.float64), params, positions)
