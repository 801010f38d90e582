"""DFlash drafting on the PyTorch backend: the drafter network bound to a torch verifier's embeddings and head."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F

from kv_cache_proposer.backends.batching import BatchLayout
from kv_cache_proposer.backends.torch_backend.verifier import TorchVerifier
from kv_cache_proposer.cache import SessionCache
from kv_cache_proposer.errors import ModelLoadError
from kv_cache_proposer.proposers.base import DraftPolicy
from kv_cache_proposer.proposers.dflash.checkpoint import load_drafter
from kv_cache_proposer.proposers.dflash.config import DFlashSpec, check_compatible
from kv_cache_proposer.proposers.dflash.model import DFlashDrafter
from kv_cache_proposer.proposers.dflash.session import DFlashBatchDrafter, DFlashDraftSession, block_masks
from kv_cache_proposer.proposers.dflash.steps import ScriptedDrafter
from kv_cache_proposer.strategies import KVStrategy
from kv_cache_proposer.verifier import BatchBlock


class DFlashProposer:
    """A DFlash drafter bound to the verifier whose embeddings, head and hidden states it uses.

    `drafter_forwards` and `context_projections` count the drafter's block forwards and context projections (one
    per call, however many sessions it serves).
    """

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
        self._steps = ScriptedDrafter(drafter)  # its forward and context projection, without Python between ops
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
        self.drafter_forwards = 0
        self.context_projections = 0
        self._batch = DFlashBatchDrafter(self)

    @classmethod
    def load(cls, directory: str | Path, verifier: TorchVerifier, *, max_draft_tokens: int = 0) -> DFlashProposer:
        drafter, spec = load_drafter(directory, device=verifier.device, dtype=verifier.dtype)
        return cls(drafter, spec, verifier, max_draft_tokens=max_draft_tokens)

    draft_policy = DraftPolicy.COST

    @property
    def name(self) -> str:
        return "dflash"

    def open(self, strategy: KVStrategy) -> DFlashDraftSession:
        return DFlashDraftSession.opened(self, strategy, self.drafter.layer_windows, self._ops, self._batch)

    @torch.inference_mode()
    def add_context(self, cache: SessionCache[torch.Tensor], features: torch.Tensor) -> None:
        """Project the verifier features [n, L*H] of the next n positions to context K/V and keep them."""
        count = features.shape[0]
        cache.begin_stage(count)
        positions = torch.tensor(cache.call.query_positions[None], device=self._device)  # [1, n]
        self.context_projections += 1
        layers = self._steps.context_kv(features[None].to(self._embed.dtype), positions)
        for index, (keys, values) in enumerate(layers):
            cache.stage_layer(index, keys, values)
        cache.commit(count)

    def join_features(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(parts))

    @torch.inference_mode()
    def draft(self, cache: SessionCache[torch.Tensor], last_token: int, count: int) -> list[int]:
        """Draft `count` tokens after `last_token`, which sits at the cache's next position."""
        block = torch.tensor([[last_token] + [self.spec.mask_token_id] * count], device=self._device)  # [1, M]
        embeds = F.embedding(block, self._embed) * self.spec.input_embedding_scale  # [1, M, H]
        cache.begin_stage(count + 1)
        query_pos = cache.call.query_positions  # [M]
        masks = [
            None if mask is None else torch.from_numpy(mask).to(self._device)[None, None]
            for mask in block_masks(cache, self.drafter.layer_windows)
        ]
        positions = torch.tensor(query_pos[None], device=self._device)  # [1, M]
        self.drafter_forwards += 1
        hidden = self._steps.forward(embeds, positions, masks, cache.stage_layer)  # [1, M, H]
        cache.commit(0)  # the block's own K/V are never kept
        return self._pick(hidden[0, 1:])

    @torch.inference_mode()
    def add_context_batch(
        self, items: Sequence[tuple[SessionCache[torch.Tensor], torch.Tensor]]
    ) -> list[Exception | None]:
        """`add_context` of several sessions with one projection over their features packed into one sequence
        (the projection is per position: each row depends on its own feature and position only)."""
        errors: list[Exception | None] = [None] * len(items)
        for index, (cache, features) in enumerate(items):
            try:
                cache.begin_stage(int(features.shape[0]))
            except Exception as exc:  # handed to that session's caller
                errors[index] = exc
        live = [index for index, error in enumerate(errors) if error is None]
        if not live:
            return errors
        features = torch.cat([items[i][1] for i in live]).to(self._embed.dtype)  # [N, L*H]
        packed = np.concatenate([items[i][0].call.query_positions for i in live])
        positions = torch.from_numpy(packed[None]).to(self._device)  # [1, N]
        self.context_projections += 1
        layers = self._steps.context_kv(features[None], positions)  # per layer [1, KVH, N, D]
        start = 0
        for i in live:
            cache, rows = items[i][0], int(items[i][1].shape[0])
            try:
                for layer, (keys, values) in enumerate(layers):
                    cache.stage_layer(layer, keys[:, :, start : start + rows], values[:, :, start : start + rows])
                cache.commit(rows)
            except Exception as exc:  # handed to that session's caller
                errors[i] = exc
            start += rows
        return errors

    @torch.inference_mode()
    def draft_batch(self, blocks: Sequence[tuple[SessionCache[torch.Tensor], int, int]]) -> list[list[int]]:
        """`draft` of several sessions in one drafter forward: their blocks packed into one sequence with
        per-token positions and a block-diagonal mask, so each block reads its own context and itself only."""
        batch = [
            BatchBlock(cache, [last_token] + [self.spec.mask_token_id] * count, count)
            for cache, last_token, count in blocks
        ]
        if len({id(block.cache) for block in batch}) != len(batch):
            raise ValueError("a batched draft takes one block per session cache")
        for block in batch:
            block.cache.begin_stage(len(block.token_ids))
        layout = BatchLayout(batch, self._ops, packed=True)
        tokens = torch.tensor(layout.token_matrix(), device=self._device)  # [1, T]
        embeds = F.embedding(tokens, self._embed) * self.spec.input_embedding_scale  # [1, T, H]
        positions = torch.from_numpy(layout.position_matrix()).to(self._device)  # [1, T]
        by_window = {w: layout.mask(window=w, causal=False) for w in set(self.drafter.layer_windows)}
        masks: list[torch.Tensor | None] = [
            torch.from_numpy(by_window[w]).to(self._device)[:, None] for w in self.drafter.layer_windows
        ]  # [1, 1, T, K]
        self.drafter_forwards += 1
        hidden = self._steps.forward(embeds, positions, masks, layout.stage_layer)  # [1, T, H]
        for block in batch:
            block.cache.commit(0)  # the blocks' own K/V are never kept
        wanted = torch.tensor(layout.logits_indices(), device=self._device)  # every block's mask positions
        picked = self._pick(hidden[0, wanted])
        out, start = [], 0
        for block in batch:
            out.append(picked[start : start + block.logits_rows])
            start += block.logits_rows
        return out

    def _pick(self, hidden: torch.Tensor) -> list[int]:
        """The greedy drafts read through the verifier's head from final hidden states [n, H]."""
        logits = self._head(hidden).float() * self.spec.output_multiplier  # [n, V]
        if self.spec.final_logit_softcapping:
            cap = self.spec.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
