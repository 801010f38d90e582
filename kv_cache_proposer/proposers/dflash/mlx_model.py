"""The DFlash drafter network on MLX: the same architecture and parameter names as `model.py`, so one drafter
directory serves both backends."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kv_cache_proposer.errors import ModelLoadError
from kv_cache_proposer.proposers.dflash.config import DFlashSpec, read_config

# Hands a layer's new keys/values [1, KVH, n, D] to storage and returns every key/value the block attends to.
KVStore = Callable[[int, mx.array, mx.array], tuple[mx.array, mx.array]]


class DFlashAttention(nn.Module):
    def __init__(self, raw: dict[str, Any], head_dim: int, theta: float) -> None:
        super().__init__()
        hidden, bias, eps = raw["hidden_size"], bool(raw.get("attention_bias", False)), raw.get("rms_norm_eps", 1e-6)
        self.num_heads = raw["num_attention_heads"]
        self.num_kv_heads = raw["num_key_value_heads"]
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, hidden, bias=bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=eps)
        self.rope = nn.RoPE(head_dim, traditional=False, base=theta)

    def _heads(self, x: mx.array, heads: int) -> mx.array:
        return x.reshape(*x.shape[:2], heads, self.head_dim).transpose(0, 2, 1, 3)  # [B, H, T, D]

    def _rotate(self, x: mx.array, offset: int | mx.array) -> mx.array:
        # nn.RoPE's signature names an int offset only; mx.fast.rope also takes one offset per batch row.
        rope = self.rope
        return mx.fast.rope(x, rope.dims, traditional=rope.traditional, base=rope.base, scale=rope.scale, offset=offset)

    def key_value(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array]:
        """Keys (normed, rotated from position `offset`, or per row from `offset[b]`) and values [B, KVH, T, D] of
        inputs x [B, T, H]."""
        keys = self._rotate(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), offset)
        return keys, self._heads(self.v_proj(x), self.num_kv_heads)

    def __call__(
        self,
        x: mx.array,
        offset: int | mx.array,
        mask: mx.array | None,
        store: Callable[[mx.array, mx.array], tuple[mx.array, mx.array]],
    ) -> mx.array:
        queries = self._rotate(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), offset)
        keys, values = store(*self.key_value(x, offset))
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.head_dim**-0.5, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(*x.shape[:2], -1))


class DFlashMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, raw: dict[str, Any], head_dim: int, theta: float) -> None:
        super().__init__()
        hidden, eps = raw["hidden_size"], raw.get("rms_norm_eps", 1e-6)
        self.self_attn = DFlashAttention(raw, head_dim, theta)
        self.mlp = DFlashMLP(hidden, raw["intermediate_size"])
        self.input_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=eps)

    def __call__(
        self,
        x: mx.array,
        offset: int | mx.array,
        mask: mx.array | None,
        store: Callable[[mx.array, mx.array], tuple[mx.array, mx.array]],
    ) -> mx.array:
        x = x + self.self_attn(self.input_layernorm(x), offset, mask, store)
        return x + self.mlp(self.post_attention_layernorm(x))


class MlxDFlashDrafter(nn.Module):
    """The drafter network. Positions are contiguous runs starting at `offset` (RoPE offsets): one for every batch
    row, or one per row (an array [B])."""

    def __init__(self, raw: dict[str, Any], num_features: int) -> None:
        super().__init__()
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
            raise ModelLoadError("the MLX DFlash drafter supports default RoPE only")
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        hidden, eps = raw["hidden_size"], raw.get("rms_norm_eps", 1e-6)
        head_dim = raw.get("head_dim") or hidden // raw["num_attention_heads"]
        self.layers = [DFlashLayer(raw, head_dim, theta) for _ in range(raw["num_hidden_layers"])]
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(num_features * hidden, hidden, bias=False)
        self.hidden_norm = nn.RMSNorm(hidden, eps=eps)
        self.hidden_size = hidden

    def context_kv(self, features: mx.array, offset: int | mx.array) -> list[tuple[mx.array, mx.array]]:
        """Per-layer context keys/values [B, KVH, N, D] of verifier features [B, N, L*H] at positions from
        `offset`."""
        context = self.hidden_norm(self.fc(features))
        return [layer.self_attn.key_value(context, offset) for layer in self.layers]

    def __call__(
        self, block_embeds: mx.array, offset: int | mx.array, masks: list[mx.array | None], store: KVStore
    ) -> mx.array:
        """Final hidden states [B, M, H] of a block of input embeddings [B, M, H] at positions from `offset`."""
        x = block_embeds
        for index, layer in enumerate(self.layers):
            x = layer(x, offset, masks[index], _store_for(store, index))
        return self.norm(x)


def _store_for(store: KVStore, index: int) -> Callable[[mx.array, mx.array], tuple[mx.array, mx.array]]:
    return lambda keys, values: store(index, keys, values)


def load_mlx_drafter(directory: str | Path, dtype: mx.Dtype) -> tuple[MlxDFlashDrafter, DFlashSpec, dict[str, Any]]:
    """Build the drafter from `directory` and load its weights (every parameter must be present)."""
    path = Path(directory)
    raw, spec = read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} holds no weights (*.safetensors)")
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(mx.load(str(file)))  # type: ignore[arg-type]
    drafter = MlxDFlashDrafter(raw, len(spec.target_layer_ids))
    try:
        drafter.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: weights do not match the DFlash format: {exc}") from exc
    drafter.set_dtype(dtype)
    mx.eval(drafter.parameters())
    drafter.eval()
    return drafter, spec, raw
