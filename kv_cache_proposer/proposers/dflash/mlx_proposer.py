"""DFlash drafting on the MLX backend: the MLX drafter network bound to an MLX verifier's embeddings and head."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from kv_cache_proposer.backends.mlx_backend.verifier import MlxVerifier
from kv_cache_proposer.cache import KVSessionCache, SessionCache
from kv_cache_proposer.proposers.base import DraftPolicy
from kv_cache_proposer.proposers.dflash.config import DFlashSpec, check_compatible, layer_windows
from kv_cache_proposer.proposers.dflash.mlx_model import MlxDFlashDrafter, load_mlx_drafter
from kv_cache_proposer.proposers.dflash.session import DFlashDraftSession, block_masks
from kv_cache_proposer.strategies import KVStrategy


class MlxDFlashProposer:
    """A DFlash drafter bound to the MLX verifier whose embeddings, head and layer outputs it uses."""

    def __init__(
        self,
        drafter: MlxDFlashDrafter,
        spec: DFlashSpec,
        windows: list[int | None],
        verifier: MlxVerifier,
        *,
        max_draft_tokens: int = 0,
    ) -> None:
        check_compatible(
            spec,
            drafter.hidden_size,
            hidden_size=verifier.hidden_size,
            num_layers=verifier.num_layers,
            vocab_size=verifier.vocab_size,
        )
        self.drafter = drafter
        self.spec = spec
        self._windows = windows
        self._verifier = verifier
        limit = spec.block_size - 1
        self.max_draft_tokens = limit if max_draft_tokens <= 0 else min(max_draft_tokens, limit)

    @classmethod
    def load(cls, directory: str | Path, verifier: MlxVerifier, *, max_draft_tokens: int = 0) -> MlxDFlashProposer:
        drafter, spec, raw = load_mlx_drafter(directory, verifier.dtype)
        return cls(drafter, spec, layer_windows(raw), verifier, max_draft_tokens=max_draft_tokens)

    draft_policy = DraftPolicy.FULL

    @property
    def name(self) -> str:
        return "dflash"

    def open(self, strategy: KVStrategy) -> DFlashDraftSession:
        cache = KVSessionCache(strategy, num_layers=len(self._windows), ops=self._verifier.array_ops)
        return DFlashDraftSession(self, cache)

    def add_context(self, cache: SessionCache[mx.array], features: mx.array) -> None:
        count = int(features.shape[0])
        with mx.stream(self._verifier.device):
            layers = self.drafter.context_kv(features[None].astype(self._verifier.dtype), cache.next_position)
            cache.begin_stage(count)
            for index, (keys, values) in enumerate(layers):
                cache.stage_layer(index, keys, values)
            cache.commit(count)

    def draft(self, cache: SessionCache[mx.array], last_token: int, count: int) -> list[int]:
        with mx.stream(self._verifier.device):
            block = mx.array([[last_token] + [self.spec.mask_token_id] * count], dtype=mx.int32)  # [1, M]
            embeds = self._verifier.embed_tokens(block) * self.spec.input_embedding_scale  # [1, M, H]
            offset = cache.next_position
            cache.begin_stage(count + 1)
            masks = [None if m is None else mx.array(m)[None, None] for m in block_masks(cache, self._windows)]
            hidden = self.drafter(embeds, offset, masks, cache.stage_layer)  # [1, M, H]
            logits = self._verifier.lm_head(hidden[0, 1:]).astype(mx.float32) * self.spec.output_multiplier
            if self.spec.final_logit_softcapping:
                cap = self.spec.final_logit_softcapping
                logits = mx.tanh(logits / cap) * cap
            tokens = mx.argmax(logits, axis=-1)
            mx.eval(tokens)
            cache.commit(0)  # the block's own K/V are never kept
        return [int(t) for t in np.array(tokens)]
