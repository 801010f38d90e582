"""The PyTorch drafter's inference forward through the verifier's scripted layer spans.

A drafter layer is a Qwen3 layer whose attention also reads the context K/V: input norm, Q/K/V projections, Q/K
norms and rotary embedding before attention; output projection, residual, norm, SiLU MLP and residual after it.
Those spans are the direct forward's `attention_inputs` and `layer_output` (`layer_steps.py`), which run as
TorchScript functions with the kernels of transformers' modules in their order, so a draft's hidden states are
bit for bit those of `DFlashDrafter.forward` (the module forward, kept for training) while a block costs a few
calls instead of a few hundred Python dispatches. The context projection (`context_kv`) runs the same way.
"""

from __future__ import annotations

import warnings
from functools import cache
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kv_cache_proposer.backends.torch_backend.layer_steps import (
    Inputs,
    Linear,
    Output,
    ScriptedSteps,
    rms_norm,
    rotate_half,
)
from kv_cache_proposer.backends.torch_backend.weights import linear
from kv_cache_proposer.proposers.dflash.model import DFlashAttention, DFlashDrafter, DFlashLayer, KVStore


def context_kv(
    features: torch.Tensor,
    fc: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    layers: list[Inputs],
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the context keys (normed, rotated) and values [B, KVH, N, D] of features [B, N, L*H]: `fc`, the
    hidden norm, then each layer's K/V projections and K norm, read from its `attention_inputs` arguments
    (`layers`: no input norm, no queries)."""
    context = rms_norm(F.linear(features, fc), norm, eps)
    batch, n = context.shape[0], context.shape[1]
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for inputs in layers:
        w_k, w_v, k_norm, head_eps = inputs[2][1], inputs[2][2], inputs[5], inputs[6]
        k = linear(context, w_k[0], w_k[1], w_k[2], w_k[3], w_k[4]).view(batch, n, -1, head_dim).transpose(1, 2)
        if k_norm is not None:
            k = rms_norm(k, k_norm, head_eps)
        k = (k * cos) + (rotate_half(k) * sin)
        v = linear(context, w_v[0], w_v[1], w_v[2], w_v[3], w_v[4])
        out.append((k, v.view(batch, n, -1, head_dim).transpose(1, 2)))
    return out


@cache
def _scripted_context_kv() -> Any:
    """`context_kv` compiled once per process (as `layer_steps` compiles its spans)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(context_kv)


def _linear(module: nn.Module) -> Linear:
    layer = cast(nn.Linear, module)
    return (layer.weight, layer.bias, None, 0, 0)  # weights.linear's DENSE kind


def _attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """A drafter layer's attention, as `DFlashAttention` runs it (grouped K/V heads read in place)."""
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True)


def _eps(norm: nn.Module) -> float:
    return float(cast(float, norm.variance_epsilon))


class ScriptedDrafter:
    """`DFlashDrafter`'s block forward and context projection, for inference, over its own parameters."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self._drafter = drafter
        self._steps = ScriptedSteps()
        self._inputs: list[Inputs] = []
        self._outputs: list[Output] = []
        self._head_dim = cast(DFlashLayer, drafter.layers[0]).self_attn.head_dim
        for module in drafter.layers:
            layer = cast(DFlashLayer, module)
            attention: DFlashAttention = layer.self_attn
            sizes = [attention.num_heads * attention.head_dim] + [attention.num_kv_heads * attention.head_dim] * 2
            self._inputs.append(
                (
                    layer.input_layernorm.weight,
                    _eps(layer.input_layernorm),
                    [_linear(attention.q_proj), _linear(attention.k_proj), _linear(attention.v_proj)],
                    sizes,
                    attention.q_norm.weight,
                    attention.k_norm.weight,
                    _eps(attention.q_norm),
                )
            )
            mlp = layer.mlp
            self._outputs.append(
                (
                    _linear(attention.o_proj),
                    layer.post_attention_layernorm.weight,
                    _eps(layer.post_attention_layernorm),
                    [_linear(mlp.gate_proj), _linear(mlp.up_proj)],
                    _linear(mlp.down_proj),
                )
            )

    def _rotary(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, 1, T, D] at `positions` [B, T] (`DFlashDrafter`'s rotary embedding, one head axis)."""
        cos, sin = self._drafter.rotary_emb(like, positions)
        return cos[:, None], sin[:, None]

    def forward(
        self, block_embeds: torch.Tensor, positions: torch.Tensor, masks: list[torch.Tensor | None], store: KVStore
    ) -> torch.Tensor:
        """`DFlashDrafter.forward`: final hidden states [B, M, H] of a block of input embeddings [B, M, H]."""
        if len(masks) != len(self._inputs):
            raise ValueError(f"{len(masks)} masks for {len(self._inputs)} drafter layers")
        cos, sin = self._rotary(block_embeds, positions)
        steps, head_dim, last = self._steps, self._head_dim, len(self._inputs) - 1
        hidden = block_embeds
        queries, keys, values = steps.first(hidden, self._inputs[0], head_dim, cos, sin)
        for index in range(last):
            attended = _attend(queries, *store(index, keys, values), masks[index])
            hidden, (queries, keys, values) = steps.between(
                hidden, attended, self._outputs[index], head_dim, self._inputs[index + 1], head_dim, cos, sin
            )
        attended = _attend(queries, *store(last, keys, values), masks[last])
        norm = self._drafter.norm
        return steps.last(hidden, attended, self._outputs[last], head_dim, (norm.weight, _eps(norm)))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`DFlashDrafter.context_kv`: per-layer context keys/values [B, KVH, N, D] of features [B, N, L*H] at
        positions [B, N]."""
        drafter = self._drafter
        cos, sin = self._rotary(features, positions)
        return cast(
            list[tuple[torch.Tensor, torch.Tensor]],
            _scripted_context_kv()(
                features,
                drafter.fc.weight,
                drafter.hidden_norm.weight,
                _eps(drafter.hidden_norm),
                self._inputs,
                cos,
                sin,
                self._head_dim,
            ),
        )
