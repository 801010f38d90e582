"""What the backends' verifiers share: the loaded model's spec and session caches over the backend's array seam."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic

import numpy as np

from kv_cache_proposer.cache import KVSessionCache, LayerStoreFactory, SessionCache
from kv_cache_proposer.cache.arrays import A, ArrayOps
from kv_cache_proposer.restoration.cache import RestoringSessionCache
from kv_cache_proposer.restoration.setup import RestorationSetup
from kv_cache_proposer.strategies import DlmRestoreStrategy, KVStrategy
from kv_cache_proposer.verifier import BatchBlock, VerifyOutput

_CPU_PREFILL_CHUNK = 512
_MAX_PREFILL_CHUNK = 8192
# Activations of one prefill forward, per token: about 16 hidden-size vectors (residual stream, Q/K/V, attention
# output, MLP gate/up/down at ~3-4x hidden) in the model's dtype. The default chunk keeps them within this bound.
_PREFILL_ACTIVATION_BYTES = 256 << 20
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DECODE_BURST_TOKENS = 4
_MLX_CPU_DECODE_BURST_TOKENS = 8
_BATCH_SIZE = 16


@dataclass(frozen=True, slots=True)
class LoadedModelSpec:
    """What a backend reads off a loaded model: its architecture's sizes and where it runs (device, dtype)."""

    backend: str
    model_type: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    device: str
    dtype: str
    kv_dtype: str = ""  # the dtype a session's dense K/V are held in, where not `dtype`

    @property
    def prefill_chunk_tokens(self) -> int:
        """The default number of pending tokens one prefill forward takes on this device.

        On a CPU a forward's fixed cost is small next to its compute, so a longer chunk gains little and only
        delays the other sessions' steps: 512. On a GPU a short chunk leaves most of the device idle: the largest
        power of two up to 8,192 whose activations stay within 256 MiB.
        """
        if self.device == "cpu":
            return _CPU_PREFILL_CHUNK
        per_token = 16 * self.hidden_size * _DTYPE_BYTES.get(self.dtype, 4)
        fits = max(_PREFILL_ACTIVATION_BYTES // per_token, 1)
        return min(_MAX_PREFILL_CHUNK, max(_CPU_PREFILL_CHUNK, 1 << (fits.bit_length() - 1)))

    @property
    def decode_burst_tokens(self) -> int:
        """The default number of plain greedy decode steps one call runs back to back (`CausalLM.burst`): 8 for MLX
        on a CPU, 4 elsewhere.

        Where the host queues work for a device that runs it asynchronously (CUDA, MPS, MLX on either device),
        a burst keeps the device busy while the host prepares the next step; the device idles once per burst, while
        the host commits it and hands its tokens over. MLX on a CPU decodes faster with the longer burst
        (docs/benchmarks.md). PyTorch on a CPU computes each operation as it is called, so there the forwards gain
        nothing, but a burst's tokens reach a daemon's stream together: one hand-over and one event-loop pass for
        four tokens, where each pass holds the interpreter lock the next forward waits for.
        """
        if self.backend == "mlx" and self.device == "cpu":
            return _MLX_CPU_DECODE_BURST_TOKENS
        return _DECODE_BURST_TOKENS

    @property
    def batch_size(self) -> int:
        """The default number of concurrent sessions' steps one forward runs (`Verifier.verify_batch`): 16, which
        gave 1.2-1.3x the tokens/s of 8 with 16 or 32 sessions generating, and about what 32 gave with 32
        (docs/benchmarks.md); an MLX verifier whose model's attention it cannot route row by row says 1
        (`MlxVerifier.batch_size`)."""
        return _BATCH_SIZE


class BackendModel(ABC, Generic[A]):
    """The backend-neutral half of a verifier: a backend adds the forward over a staged block."""

    def __init__(self, spec: LoadedModelSpec, array_ops: ArrayOps[A]) -> None:
        self.model_spec = spec
        self.array_ops = array_ops
        self.dense_store: LayerStoreFactory[A] | None = None  # holds dense K/V (None: in the model's dtype)

    @property
    def vocab_size(self) -> int:
        return self.model_spec.vocab_size

    @property
    def num_layers(self) -> int:
        return self.model_spec.num_layers

    @property
    def prefill_chunk_tokens(self) -> int:
        return self.model_spec.prefill_chunk_tokens

    @property
    def decode_burst_tokens(self) -> int:
        return self.model_spec.decode_burst_tokens

    @property
    def batch_size(self) -> int:
        return self.model_spec.batch_size

    @property
    def hidden_size(self) -> int:
        return self.model_spec.hidden_size

    @property
    def reads_held_keys(self) -> bool:
        return False

    @property
    def key_block(self) -> int | None:
        """Keys this backend's attention reads in whole blocks, if it gives a query the same values for the same
        keys at the same places in its blocks and has read a layer's keys before the next layer stages its own
        (`KVSessionCache`'s `key_block`); None: it does not."""
        return None

    @property
    def description(self) -> str:
        """Human-readable summary: backend, model type, device, dtype."""
        s = self.model_spec
        held = f", K/V: {s.kv_dtype}" if s.kv_dtype else ""
        return f"{s.backend} {s.model_type} ({s.num_layers} layers) on {s.device} {s.dtype}{held}"

    def new_cache(
        self,
        strategy: KVStrategy,
        *,
        layer_store: LayerStoreFactory[A] | None = None,
        restoration: RestorationSetup | None = None,
    ) -> SessionCache[A]:
        """A session cache under `strategy`; `layer_store` chooses what each layer stores (`dense_store` by default)
        and `restoration` how a `dlm_restore` cache restores evicted positions (default: `recompute` every layer)."""
        if isinstance(strategy, DlmRestoreStrategy):
            setup = restoration or RestorationSetup()
            ops, layers = self.array_ops, self.num_layers
            return RestoringSessionCache(
                strategy,
                num_layers=layers,
                ops=ops,
                forward_layers=self.forward_layers,
                commit=self.commit,
                chunk_tokens=setup.chunk_tokens or self.prefill_chunk_tokens,
                setup=setup,
                layer_store=layer_store,
                dense_store=self.dense_store,
                key_block=self.key_block,
            )
        return KVSessionCache(
            strategy,
            num_layers=self.num_layers,
            ops=self.array_ops,
            layer_store=layer_store or self.dense_store,
            key_block=self.key_block,
        )

    def verify(
        self,
        cache: SessionCache[A],
        token_ids: Sequence[int],
        logits_rows: int,
        *,
        feature_layers: Sequence[int] = (),
        extend_stage: bool = False,
    ) -> VerifyOutput[A]:
        """Stage the block at the cache's next positions and run the model over it (see `CausalLM.verify`)."""
        cache.begin_stage(len(token_ids), extend=extend_stage, token_ids=token_ids)
        layers = _with_restoration_layers(feature_layers, [cache])
        out = self.forward(cache, token_ids, logits_rows, layers)
        return _hand_features(self.array_ops, out, cache, layers, feature_layers)

    def verify_batch(
        self, blocks: Sequence[BatchBlock[A]], *, feature_layers: Sequence[int] = ()
    ) -> list[VerifyOutput[A]]:
        """Stage every block in its own cache and run them all in one forward (see `Verifier.verify_batch`)."""
        if len(blocks) == 1:
            block = blocks[0]
            return [self.verify(block.cache, block.token_ids, block.logits_rows, feature_layers=feature_layers)]
        if len({id(block.cache) for block in blocks}) != len(blocks):
            raise ValueError("a batched forward takes one block per session cache")
        for block in blocks:
            block.cache.begin_stage(len(block.token_ids), token_ids=block.token_ids)
        layers = _with_restoration_layers(feature_layers, [block.cache for block in blocks])
        outs = self.forward_batch(blocks, layers)
        return [
            _hand_features(self.array_ops, out, block.cache, layers, feature_layers)
            for out, block in zip(outs, blocks, strict=True)
        ]

    def forward_layers(self, cache: SessionCache[A], token_ids: Sequence[int], last_layer: int) -> None:
        """Stage the block at the cache's next positions and run layers `0..last_layer` over it, each staging its
        K/V; no later layer and no logits (a restoration's rebuild: `restoration.rebuild.LayerForward`)."""
        if not 0 <= last_layer < self.num_layers:
            raise ValueError(f"last_layer {last_layer} is outside the model's {self.num_layers} layers")
        cache.begin_stage(len(token_ids), token_ids=token_ids)
        self.run_layers(cache, token_ids, last_layer)

    def kv_from_host(self, array: np.ndarray) -> A:
        """A host array `[B, H, n, D]` as K/V of this model: in its K/V dtype, on its device."""
        return self.array_ops.from_host(array, self._kv_like())

    @abstractmethod
    def commit(self, cache: SessionCache[A], count: int) -> None:
        """Commit the first `count` staged positions of `cache` (see `Verifier.commit`), in the backend's own
        context: a rebuild's prefix chunks are committed through it too."""

    @abstractmethod
    def _kv_like(self) -> A:
        """An array of this model's K/V dtype and device."""

    @abstractmethod
    def run_layers(self, cache: SessionCache[A], token_ids: Sequence[int], last_layer: int) -> None:
        """The model's layers `0..last_layer` over the block whose stage just began (see `forward_layers`)."""

    @abstractmethod
    def burst(
        self, cache: SessionCache[A], token_ids: Sequence[int], steps: int, feature_layers: Sequence[int] = ()
    ) -> tuple[list[int], A | None]:
        """Stage `token_ids` and run `steps` greedy decode steps back to back (see `Verifier.burst`)."""

    @abstractmethod
    def forward_batch(self, blocks: Sequence[BatchBlock[A]], feature_layers: Sequence[int]) -> list[VerifyOutput[A]]:
        """The model over several blocks whose stages just began, in one model call: per block, what `forward`
        returns for it alone."""

    @abstractmethod
    def forward(
        self, cache: SessionCache[A], token_ids: Sequence[int], logits_rows: int, feature_layers: Sequence[int]
    ) -> VerifyOutput[A]:
        """The model over the block `begin_stage` just reserved: logits of its last `logits_rows` positions and
        the outputs of `feature_layers` for every position."""


def _with_restoration_layers(asked: Sequence[int], caches: Sequence[SessionCache[A]]) -> tuple[int, ...]:
    """The layers a forward captures: those the caller asked for first, then those a restoring cache needs."""
    layers = list(asked)
    for cache in caches:
        layers += [layer for layer in cache.restoration_feature_layers if layer not in layers]
    return tuple(layers)


def _hand_features(
    ops: ArrayOps[A], out: VerifyOutput[A], cache: SessionCache[A], layers: Sequence[int], asked: Sequence[int]
) -> VerifyOutput[A]:
    """Give the cache the outputs of the layers it needs (on the host) and the caller those it asked for, which
    lead the captured layers."""
    wanted, features = cache.restoration_feature_layers, out.features
    if features is None or (not wanted and len(layers) == len(asked)):
        return out
    width = int(features.shape[1]) // len(layers)  # type: ignore[attr-defined]  # [n, len(layers) * hidden]
    if wanted:
        host = ops.to_host(features)
        cache.take_features(
            np.concatenate([host[:, layers.index(i) * width : (layers.index(i) + 1) * width] for i in wanted], axis=1)
        )
    if len(layers) == len(asked):
        return out
    return VerifyOutput(out.logits, features[:, : len(asked) * width] if asked else None)  # type: ignore[index]
