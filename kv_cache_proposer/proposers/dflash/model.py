"""The DFlash block-diffusion drafter (PyTorch): a few Qwen3-style layers conditioned on verifier features.

The drafter has no embedding and no LM head of its own: it embeds its block with the verifier's input embeddings
and reads logits through the verifier's head. Its context is the verifier's hidden states at `target_layer_ids`,
concatenated and projected by `fc` then `hidden_norm`; every layer turns that context into keys and values with
its own `k_proj` / `v_proj` (plus `k_norm` and RoPE at the context positions). Queries come only from the block,
whose keys and values are appended to the context's; attention inside the block is bidirectional.

Parameter names follow the published checkpoint format: `layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
`layers.{i}.self_attn.{q,k}_norm.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
`layers.{i}.{input,post_attention}_layernorm.weight`, `norm.weight`, `fc.weight`, `hidden_norm.weight`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from kv_cache_proposer.proposers.dflash.config import layer_windows

# Hands a layer's new keys/values [B, KVH, n, D] to storage and returns every key/value the block attends to.
KVStore = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, T, D]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.num_heads = cast(int, config.num_attention_heads)
        self.num_kv_heads = cast(int, config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(*x.shape[:2], heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values [B, KVH, T, D] of inputs x [B, T, H]."""
        keys = _rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        return keys, self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        store: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        queries = _rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)  # [B, H, M, D]
        keys, values = store(*self.key_value(x, cos, sin))  # [B, KVH, K, D]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


class DFlashLayer(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        store: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, store)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The drafter network. `config` is a Qwen3 config carrying the DFlash fields."""

    def __init__(self, config: Qwen3Config, num_features: int, windows: list[int | None] | None = None) -> None:
        """`windows`: per layer, its sliding window over the context (None: every key); default: the config's
        (read from the checkpoint's raw config by `load_drafter`, since Qwen3Config drops `sliding_window`
        unless `use_sliding_window` is set)."""
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.layer_windows = layer_windows(config.to_dict()) if windows is None else list(windows)
        if len(self.layer_windows) != len(self.layers):
            raise ValueError(f"{len(self.layer_windows)} layer windows for {len(self.layers)} drafter layers")

    def layer_masks(
        self,
        allowed: torch.Tensor,
        query_pos: torch.Tensor,
        key_pos: torch.Tensor,
        windows: list[int | None] | None = None,
    ) -> list[torch.Tensor]:
        """Per-layer masks from the base visibility `allowed`; sliding-window layers also drop keys more than
        `sliding_window` positions away from the query (either side: the block is bidirectional). `windows`
        replaces the config's per-layer windows (training with varied windows)."""
        masks = []
        for window in self.layer_windows if windows is None else windows:
            masks.append(allowed if window is None else allowed & ((query_pos - key_pos).abs() < window))
        return masks

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context keys/values [B, KVH, N, D] of verifier features [B, N, L*H] at positions [B, N].

        They depend on nothing but the feature and the position, so they can be computed once per committed
        position and kept.
        """
        context = self.hidden_norm(self.fc(features))
        cos, sin = self.rotary_emb(context, positions)
        return [cast(DFlashLayer, layer).self_attn.key_value(context, cos, sin) for layer in self.layers]

    def forward(
        self, block_embeds: torch.Tensor, positions: torch.Tensor, masks: list[torch.Tensor | None], store: KVStore
    ) -> torch.Tensor:
        """Final hidden states [B, M, H] of a block of input embeddings [B, M, H] at positions [B, M].

        `masks[i]` [B or 1, 1, M, K] says which of the K keys that `store` returns for layer i each query sees
        (None: every key).
        """
        cos, sin = self.rotary_emb(block_embeds, positions)
        x = block_embeds
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, masks[index], lambda k, v, index=index: store(index, k, v))
        return self.norm(x)
