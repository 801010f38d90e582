"""Attention as a compressed K/V cache gives it, for `scripts/bench_kv_quality.py`: registered with transformers as
an attention implementation, it reads every earlier position's K/V through a K/V format (`lib/kv_formats.py`) and
each query's own position's K/V as computed, merging the two parts by their log-sum-exps."""

from __future__ import annotations

import math
from typing import Any

import torch

from lib.kv_formats import KVFormat

ATTENTION = "kakeya_kv_quality"  # the name it is registered under
_flash_cpu: Any = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (output, log-sum-exp)


class FormatAttention:
    """Attention as a compressed cache gives it (module docstring). `use(fmt)` picks the format and forgets every
    layer's read-back K/V; within one sequence, positions already read back are kept and only new ones coded."""

    def __init__(self) -> None:
        self.format: KVFormat | None = None
        self._read: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.held_bits = 0.0
        self.values = 0

    def use(self, fmt: KVFormat) -> None:
        self.format = fmt
        self._read = {}

    def _read_back(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.format is not None
        done_k, done_v = self._read.get(layer, (keys[:, :, :0], values[:, :, :0]))
        start = done_k.shape[2]
        if start < keys.shape[2]:
            parts = []
            for x in (keys[:, :, start:], values[:, :, start:]):
                flat = x.reshape(-1, x.shape[-1])
                read, bits = self.format.roundtrip(flat)
                self.held_bits += bits * flat.numel()
                self.values += flat.numel()
                parts.append(read.reshape(x.shape).to(x.dtype))
            done_k = torch.cat([done_k, parts[0]], dim=2)
            done_v = torch.cat([done_v, parts[1]], dim=2)
            self._read[layer] = (done_k, done_v)
        return done_k, done_v

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **_: Any,
    ) -> tuple[torch.Tensor, None]:
        """Query `[B, H, n, D]` at the last n of key's K positions `[B, Hkv, K, D]` (batch 1, full attention)."""
        n, total = query.shape[2], key.shape[2]
        read_k, read_v = self._read_back(int(module.layer_idx), key, value)  # type: ignore[arg-type]
        groups = query.shape[1] // key.shape[1]
        scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
        own_k, own_v = key[:, :, total - n :], value[:, :, total - n :]
        if groups > 1:
            read_k, read_v = read_k.repeat_interleave(groups, 1), read_v.repeat_interleave(groups, 1)
            own_k, own_v = own_k.repeat_interleave(groups, 1), own_v.repeat_interleave(groups, 1)
        own_score = (query * own_k).sum(-1) * scale  # [B, H, n]
        earlier = total - n
        if earlier == 0 and n == 1:
            return own_v.transpose(1, 2).contiguous(), None
        if earlier == 0:
            # row i reads the read-back keys 0..i-1: the queries after the first over the keys before the last,
            # causally; the first query reads only itself
            past, past_lse = _flash_cpu(
                query[:, :, 1:], read_k[:, :, :-1], read_v[:, :, :-1], is_causal=True, scale=scale
            )
            first = torch.full_like(past_lse[:, :, :1], -math.inf)
            past = torch.cat([torch.zeros_like(past[:, :, :1]), past], dim=2)
            past_lse = torch.cat([first, past_lse], dim=2)
        elif n == 1:
            past, past_lse = _flash_cpu(query, read_k[:, :, :earlier], read_v[:, :, :earlier], scale=scale)
        else:
            positions = torch.arange(earlier, total)
            visible = torch.arange(total)[None, :] < positions[:, None]  # [n, K]: strictly earlier positions
            mask = torch.zeros(visible.shape, dtype=query.dtype).masked_fill(~visible, -math.inf)
            past, past_lse = _flash_cpu(query, read_k, read_v, attn_mask=mask[None, None], scale=scale)
        top = torch.maximum(past_lse, own_score)
        past_weight = torch.exp(past_lse - top).unsqueeze(-1)
        own_weight = torch.exp(own_score - top).unsqueeze(-1)
        merged = (past * past_weight + own_v * own_weight) / (past_weight + own_weight)
        return merged.transpose(1, 2).contiguous(), None
