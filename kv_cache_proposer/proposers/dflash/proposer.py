"""DFlash drafting on the PyTorch backend.

Each session keeps the drafter's context K/V for committed positions only, under the session's KV strategy. The
verifier's features of a position arrive with the commit that makes it resident (captured by the same forward),
are projected to context K/V at once, and are never recomputed. A proposal runs one drafter forward over
`[last token, MASK x n]` at the next positions and reads the n drafts through the verifier's LM head; the block's
own K/V are staged and dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from kv_cache_proposer.backends.torch_backend.kv_store import TorchSessionCache
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.errors import EngineError, ModelLoadError
from kv_cache_proposer.proposers.dflash.checkpoint import DFlashSpec, load_drafter
from kv_cache_proposer.proposers.dflash.model import DFlashDrafter
from kv_cache_proposer.strategies import KVStrategy


class DFlashProposer:
    """A DFlash drafter bound to the verifier whose embeddings, head and hidden states it uses."""

    def __init__(
        self, drafter: DFlashDrafter, spec: DFlashSpec, verifier: TorchVerifier, *, max_draft_tokens: int = 0
    ) -> None:
        _check_compatible(drafter, spec, verifier)
        self.drafter = drafter
        self.spec = spec
        self._embed = cast(torch.Tensor, verifier.model.get_input_embeddings().weight)  # [V, H]
        head = verifier.model.get_output_embeddings()
        if head is None:
            raise ModelLoadError("the verifier has no output embeddings (LM head) for the drafter to borrow")
        self._head: torch.nn.Module = head
        self._device = verifier.device
        limit = spec.block_size - 1
        self.max_draft_tokens = limit if max_draft_tokens <= 0 else min(max_draft_tokens, limit)

    @classmethod
    def load(cls, directory: str | Path, verifier: TorchVerifier, *, max_draft_tokens: int = 0) -> DFlashProposer:
        drafter, spec = load_drafter(directory, device=verifier.device, dtype=verifier.dtype)
        return cls(drafter, spec, verifier, max_draft_tokens=max_draft_tokens)

    @property
    def name(self) -> str:
        return "dflash"

    def open(self, strategy: KVStrategy) -> DFlashDraftSession:
        cache = TorchSessionCache(strategy, num_layers=len(self.drafter.layers), device=self._device)
        return DFlashDraftSession(self, cache)

    @torch.inference_mode()
    def add_context(self, cache: TorchSessionCache, features: torch.Tensor) -> None:
        """Project the verifier features [n, L*H] of the next n positions to context K/V and keep them."""
        count = features.shape[0]
        start = cache.next_position
        positions = torch.arange(start, start + count, device=self._device)[None]  # [1, n]
        layers = self.drafter.context_kv(features[None].to(self._embed.dtype), positions)
        cache.begin_stage(count)
        for index, (keys, values) in enumerate(layers):
            cache.stage_layer(index, keys, values)
        cache.commit(count)

    @torch.inference_mode()
    def draft(self, cache: TorchSessionCache, last_token: int, count: int) -> list[int]:
        """Draft `count` tokens after `last_token`, which sits at the cache's next position."""
        block = torch.tensor([[last_token] + [self.spec.mask_token_id] * count], device=self._device)  # [1, M]
        embeds = F.embedding(block, self._embed) * self.spec.input_embedding_scale  # [1, M, H]
        key_pos = cache.begin_stage(count + 1)  # [K]
        query_pos = key_pos[-(count + 1) :]  # [M]
        q, k = query_pos[:, None], key_pos[None, :]
        allowed = (k >= 0) & cache.strategy.visible(q, k)  # [M, K]: the context under the strategy, the block
        masks = [mask[None, None] for mask in self.drafter.layer_masks(allowed, q, k)]
        hidden = self.drafter(embeds, query_pos[None], masks, cache.stage_layer)  # [1, M, H]
        cache.commit(0)  # the block's own K/V are never kept
        logits = self._head(hidden[0, 1:]).float() * self.spec.output_multiplier  # [count, V]
        if self.spec.final_logit_softcapping:
            cap = self.spec.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return [int(t) for t in logits.argmax(dim=-1).tolist()]


class DFlashDraftSession:
    """One session's drafter context."""

    def __init__(self, proposer: DFlashProposer, cache: TorchSessionCache) -> None:
        self._proposer = proposer
        self._cache = cache

    @property
    def max_draft_tokens(self) -> int:
        return self._proposer.max_draft_tokens

    @property
    def feature_layers(self) -> Sequence[int]:
        return self._proposer.spec.target_layer_ids

    @property
    def nbytes(self) -> int:
        return self._cache.nbytes

    def propose(self, history: Sequence[int], max_tokens: int) -> list[int]:
        # Drafting needs the features of every position before the last token; after an append the pending
        # tokens have none yet, so that step verifies them without a draft.
        if self._cache.next_position != len(history) - 1 or max_tokens < 1:
            return []
        return self._proposer.draft(self._cache, history[-1], min(max_tokens, self.max_draft_tokens))

    def on_commit(self, history: Sequence[int], committed: int, features: Any | None) -> None:
        if features is None:
            raise EngineError("the DFlash drafter needs verifier features with every commit")
        count = int(features.shape[0])
        if committed - count != self._cache.next_position:
            raise EngineError(
                f"DFlash context holds {self._cache.next_position} positions but features arrived for "
                f"{committed - count}..{committed}"
            )
        if count:
            self._proposer.add_context(self._cache, features)

    def release(self) -> None:
        self._cache.release()


def _check_compatible(drafter: DFlashDrafter, spec: DFlashSpec, verifier: TorchVerifier) -> None:
    if drafter.config.hidden_size != verifier.hidden_size:
        raise ModelLoadError(
            f"the drafter's hidden size {drafter.config.hidden_size} differs from the verifier's {verifier.hidden_size}"
        )
    if max(spec.target_layer_ids) >= verifier.num_layers or min(spec.target_layer_ids) < 0:
        raise ModelLoadError(
            f"target_layer_ids {list(spec.target_layer_ids)} do not fit a verifier of {verifier.num_layers} layers"
        )
    if spec.num_target_layers is not None and spec.num_target_layers != verifier.num_layers:
        raise ModelLoadError(
            f"the drafter was built for a verifier of {spec.num_target_layers} layers, this one has "
            f"{verifier.num_layers}"
        )
    if not 0 <= spec.mask_token_id < verifier.vocab_size:
        raise ModelLoadError(f"mask_token_id {spec.mask_token_id} is outside the verifier vocabulary")
