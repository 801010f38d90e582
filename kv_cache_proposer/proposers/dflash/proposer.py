"""DFlash drafting on the PyTorch backend: the drafter network bound to a torch verifier's embeddings and head."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F

from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.cache import KVSessionCache, SessionCache
from kv_cache_proposer.errors import ModelLoadError
from kv_cache_proposer.proposers.base import DraftPolicy
from kv_cache_proposer.proposers.dflash.checkpoint import load_drafter
from kv_cache_proposer.proposers.dflash.config import DFlashSpec, check_compatible
from kv_cache_proposer.proposers.dflash.model import DFlashDrafter
from kv_cache_proposer.proposers.dflash.session import DFlashDraftSession, block_masks
from kv_cache_proposer.strategies import KVStrategy


class DFlashProposer:
    """A DFlash drafter bound to the verifier whose embeddings, head and hidden states it uses."""

    def __init__(
        self, drafter: DFlashDrafter, spec: DFlashSpec, verifier: TorchVerifier, *, max_draft_tokens: int = 0
    ) -> None:
        check_compatible(
            spec,
            drafter.config.hidden_size,
            hidden_size=verifier.hidden_size,
            num_layers=verifier.num_layers,
            vocab_size=verifier.vocab_size,
        )
        self.drafter = drafter
        self.spec = spec
        self._embed = cast(torch.Tensor, verifier.model.get_input_embeddings().weight)  # [V, H]
        head = verifier.model.get_output_embeddings()
        if head is None:
            raise ModelLoadError("the verifier has no output embeddings (LM head) for the drafter to borrow")
        self._head: torch.nn.Module = head
        self._device = verifier.device
        self._ops = verifier.array_ops
        limit = spec.block_size - 1
        self.max_draft_tokens = limit if max_draft_tokens <= 0 else min(max_draft_tokens, limit)

    @classmethod
    def load(cls, directory: str | Path, verifier: TorchVerifier, *, max_draft_tokens: int = 0) -> DFlashProposer:
        drafter, spec = load_drafter(directory, device=verifier.device, dtype=verifier.dtype)
        return cls(drafter, spec, verifier, max_draft_tokens=max_draft_tokens)

    draft_policy = DraftPolicy.FULL

    @property
    def name(self) -> str:
        return "dflash"

    def open(self, strategy: KVStrategy) -> DFlashDraftSession:
        cache = KVSessionCache(strategy, num_layers=len(self.drafter.layers), ops=self._ops)
        return DFlashDraftSession(self, cache)

    @torch.inference_mode()
    def add_context(self, cache: SessionCache[torch.Tensor], features: torch.Tensor) -> None:
        """Project the verifier features [n, L*H] of the next n positions to context K/V and keep them."""
        count = features.shape[0]
        cache.begin_stage(count)
        positions = torch.tensor(cache.query_positions[None], device=self._device)  # [1, n]
        layers = self.drafter.context_kv(features[None].to(self._embed.dtype), positions)
        for index, (keys, values) in enumerate(layers):
            cache.stage_layer(index, keys, values)
        cache.commit(count)

    @torch.inference_mode()
    def draft(self, cache: SessionCache[torch.Tensor], last_token: int, count: int) -> list[int]:
        """Draft `count` tokens after `last_token`, which sits at the cache's next position."""
        block = torch.tensor([[last_token] + [self.spec.mask_token_id] * count], device=self._device)  # [1, M]
        embeds = F.embedding(block, self._embed) * self.spec.input_embedding_scale  # [1, M, H]
        cache.begin_stage(count + 1)
        query_pos = cache.query_positions  # [M]
        masks = [
            None if mask is None else torch.from_numpy(mask).to(self._device)[None, None]
            for mask in block_masks(cache, self.drafter.layer_windows)
        ]
        positions = torch.tensor(query_pos[None], device=self._device)  # [1, M]
        hidden = self.drafter(embeds, positions, masks, cache.stage_layer)  # [1, M, H]
        cache.commit(0)  # the block's own K/V are never kept
        logits = self._head(hidden[0, 1:]).float() * self.spec.output_multiplier  # [count, V]
        if self.spec.final_logit_softcapping:
            cap = self.spec.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
