"""DFlash drafting on the MLX backend: the MLX drafter network bound to an MLX verifier's embeddings and head."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from kv_cache_proposer.backends.batching import BatchLayout
from kv_cache_proposer.backends.mlx_backend.layout import input_major
from kv_cache_proposer.backends.mlx_backend.verifier import MlxVerifier
from kv_cache_proposer.cache import SessionCache
from kv_cache_proposer.proposers.base import DraftPolicy
from kv_cache_proposer.proposers.dflash.config import DFlashSpec, check_compatible, layer_windows
from kv_cache_proposer.proposers.dflash.mlx_model import MlxDFlashDrafter, load_mlx_drafter
from kv_cache_proposer.proposers.dflash.session import DFlashBatchDrafter, DFlashDraftSession, block_masks
from kv_cache_proposer.strategies import KVStrategy
from kv_cache_proposer.verifier import BatchBlock


class MlxDFlashProposer:
    """A DFlash drafter bound to the MLX verifier whose embeddings, head and layer outputs it uses.

    `drafter_forwards` and `context_projections` count the drafter's block forwards and context projections (one
    per call, however many sessions it serves).
    """

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
        self.drafter_forwards = 0
        self.context_projections = 0
        self._batch = DFlashBatchDrafter(self)

    @classmethod
    def load(cls, directory: str | Path, verifier: MlxVerifier, *, max_draft_tokens: int = 0) -> MlxDFlashProposer:
        drafter, spec, raw = load_mlx_drafter(directory, verifier.dtype)
        if verifier.input_major:  # the drafter's products run on the same CPU as the verifier's
            input_major(drafter)
        return cls(drafter, spec, layer_windows(raw), verifier, max_draft_tokens=max_draft_tokens)

    draft_policy = DraftPolicy.COST

    @property
    def name(self) -> str:
        return "dflash"

    def open(self, strategy: KVStrategy) -> DFlashDraftSession:
        return DFlashDraftSession.opened(self, strategy, self._windows, self._verifier.array_ops, self._batch)

    def add_context(self, cache: SessionCache[mx.array], features: mx.array) -> None:
        count = int(features.shape[0])
        with mx.stream(self._verifier.device):
            self.context_projections += 1
            layers = self.drafter.context_kv(features[None].astype(self._verifier.dtype), cache.next_position)
            cache.begin_stage(count)
            for index, (keys, values) in enumerate(layers):
                cache.stage_layer(index, keys, values)
            cache.commit(count)

    def join_features(self, parts: Sequence[mx.array]) -> mx.array:
        return mx.concatenate(list(parts))

    def draft(self, cache: SessionCache[mx.array], last_token: int, count: int) -> list[int]:
        with mx.stream(self._verifier.device):
            block = mx.array([[last_token] + [self.spec.mask_token_id] * count], dtype=mx.int32)  # [1, M]
            embeds = self._verifier.embed_tokens(block) * self.spec.input_embedding_scale  # [1, M, H]
            offset = cache.next_position
            cache.begin_stage(count + 1)
            masks = [None if m is None else mx.array(m)[None, None] for m in block_masks(cache, self._windows)]
            self.drafter_forwards += 1
            hidden = self.drafter(embeds, offset, masks, cache.stage_layer)  # [1, M, H]
            tokens = self._pick(hidden[0, 1:])
            mx.eval(tokens)
            cache.commit(0)  # the block's own K/V are never kept
        return [int(t) for t in np.array(tokens)]

    def add_context_batch(self, items: Sequence[tuple[SessionCache[mx.array], mx.array]]) -> list[Exception | None]:
        """`add_context` of several sessions with one projection: one batch row per session, right-padded with
        zero features to the longest, each row rotated from its own first position (the projection is per
        position, so padding changes no real row)."""
        errors: list[Exception | None] = [None] * len(items)
        starts = [0] * len(items)  # each row's first position
        for index, (cache, features) in enumerate(items):
            try:
                starts[index] = cache.next_position
                cache.begin_stage(int(features.shape[0]))
            except Exception as exc:  # handed to that session's caller
                errors[index] = exc
        live = [index for index, error in enumerate(errors) if error is None]
        if not live:
            return errors
        counts = [int(items[i][1].shape[0]) for i in live]
        width = max(counts)
        with mx.stream(self._verifier.device):
            rows = [
                mx.pad(items[i][1], [(0, width - count), (0, 0)]) if count < width else items[i][1]
                for i, count in zip(live, counts, strict=True)
            ]
            features = mx.stack(rows).astype(self._verifier.dtype)  # [B, N, L*H]
            offsets = mx.array([starts[i] for i in live], dtype=mx.int32)  # [B]
            self.context_projections += 1
            layers = self.drafter.context_kv(features, offsets)  # per layer [B, KVH, N, D]
            for row, (i, count) in enumerate(zip(live, counts, strict=True)):
                cache = items[i][0]
                try:
                    for layer, (keys, values) in enumerate(layers):
                        cache.stage_layer(layer, keys[row : row + 1, :, :count], values[row : row + 1, :, :count])
                    cache.commit(count)
                except Exception as exc:  # handed to that session's caller
                    errors[i] = exc
        return errors

    def draft_batch(self, blocks: Sequence[tuple[SessionCache[mx.array], int, int]]) -> list[list[int]]:
        """`draft` of several sessions in one drafter forward: one batch row per block, left-padded to the
        longest, each rotated from its own position and masked to its own context and block."""
        batch = [
            BatchBlock(cache, [last_token] + [self.spec.mask_token_id] * count, count)
            for cache, last_token, count in blocks
        ]
        if len({id(block.cache) for block in batch}) != len(batch):
            raise ValueError("a batched draft takes one block per session cache")
        for block in batch:
            block.cache.begin_stage(len(block.token_ids))
        layout = BatchLayout(batch, self._verifier.array_ops, packed=False, join_batch=lambda p: mx.concatenate(p, 0))
        with mx.stream(self._verifier.device):
            tokens = mx.array(layout.token_matrix(self.spec.mask_token_id), dtype=mx.int32)  # [B, T]
            embeds = self._verifier.embed_tokens(tokens) * self.spec.input_embedding_scale  # [B, T, H]
            offsets = mx.array(layout.position_matrix()[:, 0].astype(np.int32))  # [B]
            by_window = {w: mx.array(layout.mask(window=w, causal=False)[:, None]) for w in set(self._windows)}
            masks: list[mx.array | None] = [by_window[w] for w in self._windows]  # [B, 1, T, K]
            self.drafter_forwards += 1
            hidden = self.drafter(embeds, offsets, masks, layout.stage_layer)  # [B, T, H]
            rows = [hidden[row, start + 1 : end] for row, start, end in map(layout.query_span, range(len(batch)))]
            picked = self._pick(mx.concatenate(rows))
            mx.eval(picked)
            for block in batch:
                block.cache.commit(0)  # the blocks' own K/V are never kept
        out, start = [], 0
        flat = [int(t) for t in np.array(picked)]
        for block in batch:
            out.append(flat[start : start + block.logits_rows])
            start += block.logits_rows
        return out

    def _pick(self, hidden: mx.array) -> mx.array:
        """The greedy drafts [n] read through the verifier's head from final hidden states [n, H]."""
        logits = self._verifier.lm_head(hidden).astype(mx.float32) * self.spec.output_multiplier  # [n, V]
        if self.spec.final_logit_softcapping:
            cap = self.spec.final_logit_softcapping
            logits = mx.tanh(logits / cap) * cap
        return mx.argmax(logits, axis=-1)
