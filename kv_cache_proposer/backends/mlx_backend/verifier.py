"""The MLX verifier: one forward per block through mlx-lm's own model classes and its cache protocol."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kv_cache_proposer import sampling
from kv_cache_proposer.backends.base import BackendModel, LoadedModelSpec
from kv_cache_proposer.backends.batching import BatchLayout
from kv_cache_proposer.backends.mlx_backend.arrays import MlxArrayOps
from kv_cache_proposer.backends.mlx_backend.attention import (
    RowStagingLayer,
    batch_staging_layers,
    route_rows,
    staging_layers,
)
from kv_cache_proposer.backends.mlx_backend.features import recorded_features, recording
from kv_cache_proposer.backends.mlx_backend.loader import LoadedModel, load_mlx_model, resolve_device, resolve_dtype
from kv_cache_proposer.backends.mlx_blas import active_mlx_blas
from kv_cache_proposer.cache import SessionCache
from kv_cache_proposer.errors import EngineError
from kv_cache_proposer.sampling import SamplingParams
from kv_cache_proposer.verifier import BatchBlock, VerifyOutput

# Below this many K/V-only positions a second model call costs more than the rows it saves (measured on the tiny
# test models on a CPU, where the crossover lies between 64 and 128; larger vocabularies save more per row).
_KV_ONLY_MIN_TOKENS = 64

# On a Linux CPU with the wheel's own BLAS, whose products sum in plain loops, a row's values do not depend on the
# rows beside it, and attention gives a query the same values when whole blocks of 64 masked keys lie before,
# between or after the keys it reads (tests check both). So a bounded cache that hands it keys at places set by their
# positions (`key_block`) gives the same values however the history arrived, as an unbounded one does by itself.
# Blocks of 64 rather than torch's 512: a window's partial blocks add fewer keys to read (a bounded session decoded
# at 0.70x the ring's order with 512, about 0.9x with 64; docs/benchmarks.md).
_CPU_KEY_BLOCK = 64


class MlxVerifier(BackendModel[mx.array]):
    """An mlx-lm causal LM serving per-session caches.

    Every call evaluates what it produced (logits and K/V) before it returns, so neither the cache nor the caller
    holds a lazy graph across calls, and the arrays can be read from any thread.
    """

    def __init__(self, loaded: LoadedModel, *, device: mx.Device) -> None:
        spec = LoadedModelSpec(
            backend="mlx",
            model_type=loaded.model_type,
            vocab_size=loaded.vocab_size,
            num_layers=loaded.num_layers,
            hidden_size=loaded.hidden_size,
            device="gpu" if device.type == mx.gpu else "cpu",
            dtype=str(loaded.dtype).removeprefix("mlx.core."),
        )
        super().__init__(spec, MlxArrayOps())
        self.model: nn.Module = loaded.model
        self.device = device
        self.dtype = loaded.dtype
        self._layer_windows = loaded.layer_windows
        self.rows_routed = route_rows(self.model)
        """Whether a batched forward attends row by row over each row's own keys (`attention.route_rows`)."""
        self._input_major = loaded.input_major_modules
        self.weights = loaded.weights

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        input_major: bool | None = None,
        weights: str = "float32",
    ) -> MlxVerifier:
        """`input_major`: store linear layers and embeddings `[in, out]` (`layout.input_major`); None: on a CPU.
        `weights`: float32 serves the directory's weights as they are stored (an mlx-lm quantized directory stays
        quantized); int8 and int4 quantize the linear layers and embeddings at load (`loader.quantize_weights`)."""
        mlx_device = resolve_device(device)
        if input_major is None:
            input_major = mlx_device.type == mx.cpu
        loaded = load_mlx_model(model_dir, resolve_dtype(dtype, mlx_device), input_major=input_major, weights=weights)
        return cls(loaded, device=mlx_device)

    @property
    def input_major(self) -> bool:
        """Whether the model's linear layers and embeddings are stored input-major (`layout.input_major`)."""
        return self._input_major > 0

    @property
    def batch_size(self) -> int:
        """The spec's, where batched rows are attended row by row (`rows_routed`); 1 where they would be padded to
        the longest history's keys and read under a mask, which decoded slower than one forward per step
        (docs/benchmarks.md)."""
        return super().batch_size if self.rows_routed else 1

    @property
    def key_block(self) -> int | None:
        """`_CPU_KEY_BLOCK` on a Linux CPU with the bundled BLAS. An optimised BLAS (`--mlx-blas auto` with a system
        OpenBLAS), Accelerate and the GPU's kernels sum a row in orders that depend on the shape around it, so there
        the layout's copy would buy nothing: a bounded cache keeps its ring's order and agrees within float
        rounding."""
        exact = self.device.type == mx.cpu and sys.platform == "linux" and active_mlx_blas().bundled
        return _CPU_KEY_BLOCK if exact else None

    @property
    def description(self) -> str:
        parts = [super().description]
        if self.weights != "float32":
            parts.append(f"weights: {self.weights}")
        if self._input_major:
            parts.append(f"weights: input-major ({self._input_major} modules)")
        if self.device.type == mx.cpu and sys.platform == "linux":
            parts.append(f"CPU BLAS: {active_mlx_blas()}")
        return ", ".join(parts)

    def forward(
        self, cache: SessionCache[mx.array], token_ids: Sequence[int], logits_rows: int, feature_layers: Sequence[int]
    ) -> VerifyOutput[mx.array]:
        with recording(self.model, feature_layers) as taps, mx.stream(self.device):
            rows = self._logits(cache, token_ids, logits_rows)  # [rows, V]
            features = None
            if taps:  # each tap saw the block in one or two model calls
                features = recorded_features(taps)  # [n, L*H]
                mx.eval(rows, features, cache.arrays())
            else:
                mx.eval(rows, cache.arrays())
        return VerifyOutput(rows, features)

    def run_layers(self, cache: SessionCache[mx.array], token_ids: Sequence[int], last_layer: int) -> None:
        with mx.stream(self.device):
            input_ids = mx.array([list(token_ids)], dtype=mx.int32)  # [1, n]
            # mlx-lm runs one layer per cache entry it is given: the later layers never run, and nothing evaluates
            # the head's lazy output.
            self.model(input_ids, cache=staging_layers(cache, self._layer_windows)[: last_layer + 1])
            mx.eval(cache.arrays())

    def _logits(self, cache: SessionCache[mx.array], token_ids: Sequence[int], logits_rows: int) -> mx.array:
        """The lazy float32 logits `[rows, V]` of the block's last `logits_rows` positions; its K/V staged."""
        block_len = len(token_ids)
        # Positions before the logits rows only need their K/V: a separate model call for them is never asked for
        # its last layer's output or its LM head rows, as in mlx-lm's own prefill.
        head = block_len - logits_rows if block_len - logits_rows >= _KV_ONLY_MIN_TOKENS else 0
        input_ids = mx.array([list(token_ids)], dtype=mx.int32)  # [1, n]
        layers = staging_layers(cache, self._layer_windows)
        base = cache.call.query_offset - cache.next_position  # index in the stage of the block's start
        if head:
            cache.select_queries(base, base + head)
            self.model(input_ids[:, :head], cache=layers)  # outputs never evaluated
            cache.select_queries(base + head, base + block_len)
        logits = self.model(input_ids[:, head:], cache=layers)  # [1, n - head, V]
        return logits[0, -logits_rows:].astype(mx.float32)

    def burst(
        self,
        cache: SessionCache[mx.array],
        token_ids: Sequence[int],
        steps: int,
        feature_layers: Sequence[int] = (),
    ) -> tuple[list[int], mx.array | None]:
        # Every step's token, the first one's included, stays a lazy array that feeds the next forward and is
        # evaluated asynchronously: the device computes one step while the host builds the next step's graph, and
        # the host waits once, for the last.
        with mx.stream(self.device):
            first_features = None
            if cache.restoration_feature_layers:  # a restoring cache takes the block's features: a whole verify
                out = self.verify(cache, token_ids, 1, feature_layers=feature_layers)
                first, first_features = out.logits, out.features  # [1, V], [n, L*H]
            with recording(self.model, feature_layers) as taps:
                if not cache.restoration_feature_layers:
                    cache.begin_stage(len(token_ids), token_ids=token_ids)
                    first = self._logits(cache, token_ids, 1)
                tokens = [mx.argmax(first, axis=-1)]  # [1] each
                mx.async_eval(tokens[-1])
                layers = staging_layers(cache, self._layer_windows)
                for _ in range(steps - 1):
                    cache.begin_stage(1, extend=True)
                    logits = self.model(tokens[-1][None].astype(mx.int32), cache=layers)  # [1, 1, V]
                    tokens.append(mx.argmax(logits[0].astype(mx.float32), axis=-1))
                    mx.async_eval(tokens[-1])
                picked = mx.concatenate(tokens)  # [steps]
                features = None
                if taps:  # each tap saw the block (in one or two calls, unless verified above), then every step
                    features = recorded_features(taps)  # [positions recorded, L*H]
                    if first_features is not None:
                        features = mx.concatenate([first_features, features], axis=0)
                    mx.eval(picked, features, cache.arrays())
                else:
                    mx.eval(picked, cache.arrays())
        picks = [int(t) for t in np.array(picked)]
        cache.name_stage([*token_ids, *picks[:-1]])
        return picks, features

    def forward_batch(
        self, blocks: Sequence[BatchBlock[mx.array]], feature_layers: Sequence[int]
    ) -> list[VerifyOutput[mx.array]]:
        # Padded: mlx-lm's RoPE takes one offset per batch row, not per token, so each block gets its own row. Where
        # the model's attention is routed (`route_rows`), each row reads its own keys, unpadded; else every row's keys
        # are padded to the longest and read under one mask.
        layout = BatchLayout(blocks, self.array_ops, packed=False, join_batch=lambda parts: mx.concatenate(parts, 0))
        with recording(self.model, feature_layers) as taps, mx.stream(self.device):
            input_ids = mx.array(layout.token_matrix(), dtype=mx.int32)  # [B, T]
            layers = batch_staging_layers(layout, self._layer_windows, by_row=self.rows_routed)
            logits = self.model(input_ids, cache=layers)  # [B, T, V]
            if any(isinstance(layer, RowStagingLayer) and layer.attended != 1 for layer in layers):
                raise EngineError("a layer of this model attended without mlx-lm's scaled_dot_product_attention")
            features = None
            if taps:
                features = mx.concatenate([(tap.recording.outputs or [])[-1] for tap in taps], axis=-1)
            outputs = []
            for index, block in enumerate(blocks):
                row, start, end = layout.query_span(index)
                rows = logits[row, end - block.logits_rows : end].astype(mx.float32)  # [rows, V]
                outputs.append(VerifyOutput(rows, None if features is None else features[row, start:end]))
            mx.eval(
                [out.logits for out in outputs],
                [out.features for out in outputs if out.features is not None],
                [array for block in blocks for array in block.cache.arrays()],
            )
        return outputs

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
            raise EngineError(f"cannot find the input embeddings of this {self.model_spec.model_type} model")
        return inner

    def commit(self, cache: SessionCache[mx.array], count: int) -> None:
        with mx.stream(self.device):
            cache.commit(count)

    def _kv_like(self) -> mx.array:
        return mx.zeros((0,), dtype=self.dtype)

    def pick_tokens(self, logits: mx.array, params: SamplingParams, positions: Sequence[int]) -> list[int]:
        if params.greedy:  # on the device: only the token ids cross to the host
            return [int(t) for t in np.array(mx.argmax(logits, axis=-1))]
        return sampling.pick_tokens(self.host_logits(logits), params, positions)

    def host_logits(self, logits: mx.array) -> np.ndarray:
        return np.array(logits, dtype=np.float64)
