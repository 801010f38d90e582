"""The llama family's forward, run directly over the model's own weights: transformers' operations in transformers'
order on the same tensors, without the Python around them (a decoder layer is its K/V staging and attention
between spans of compute, `layer_steps`). The values are transformers' bit for bit except where a block over a long
history attends in two parts (`_attend_over_history`). Any other architecture, attention implementation or module
layout runs through transformers' modules (`unsupported` says why). docs/architecture.md ("The decode step")
describes both paths and where their values differ.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import repeat_kv, use_gqa_in_sdpa
from transformers.modeling_utils import slice_logits_to_keep

from kv_cache_proposer.backends.batching import RowKeys
from kv_cache_proposer.backends.torch_backend.chunked_attention import attend_parts
from kv_cache_proposer.backends.torch_backend.layer_steps import (
    CompiledSteps,
    Inputs,
    LayerSteps,
    Linear,
    Output,
    ScriptedSteps,
)
from kv_cache_proposer.backends.torch_backend.weights import DENSE, PackedLinear, linear
from kv_cache_proposer.cache.protocol import KeyPart

_flash_cpu: Any = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (output, log-sum-exp)

DIRECT_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

Staged = tuple[KeyPart[torch.Tensor], ...] | list[RowKeys[torch.Tensor]]
"""What a layer's attention reads, in parts (`SessionCache.stage_layer_parts`), or per row of a packed batched
forward (`BatchLayout.stage_layer_rows`)."""
Stage = Callable[[int, torch.Tensor, torch.Tensor], Staged]
"""Stages a layer's K/V and returns what its attention reads."""

# The mask of a block that reads every earlier key, then its own keys causally (`DirectForward.splits`).
OVER_HISTORY: Final = "over history"
Masks = torch.Tensor | Mapping[str, torch.Tensor] | Literal["over history"] | None

# Queries times earlier keys from which the split attention beats one masked call on a CPU: below it the second
# kernel call and the merge cost more than the mask saves (measured on the bundled model, one thread and two).
SPLIT_MIN_PAIRS: Final = 131_072

# The most queries of a block that runs the compiled spans: decode steps and speculative blocks, of one sequence or
# a batch of them. A longer block (a prefill chunk) runs the scripted spans: its time is the matrix products'.
COMPILED_MAX_QUERIES: Final = 64


@dataclass(frozen=True, slots=True)
class _Layer:
    inputs: Inputs
    output: Output
    kind: str  # the layer's attention type, which picks its mask
    groups: int  # query heads per K/V head
    head_dim: int
    scaling: float


def unsupported(model: PreTrainedModel) -> str | None:
    """Why `model` must run through transformers' modules, or None where the direct forward serves it."""
    config = model.config.get_text_config()
    model_type = str(config.model_type)
    if model_type not in DIRECT_MODEL_TYPES:
        return f"model type {model_type} (the direct forward serves {', '.join(sorted(DIRECT_MODEL_TYPES))})"
    if model.config._attn_implementation != "sdpa":
        return f"attention implementation {model.config._attn_implementation} (the direct forward uses sdpa)"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)} (the direct forward runs silu)"
    decoder = model.get_decoder()
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(decoder, name):
            return f"the decoder has no {name}"
    return None


class DirectForward:
    """The forward of a supported model (`unsupported(model)` is None) over its parameters, read at construction:
    the model's weights are shared, not copied."""

    def __init__(self, model: PreTrainedModel, layer_types: Sequence[str]) -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"the direct forward cannot serve this model: {reason}")
        decoder: Any = model.get_decoder()
        self._embed = decoder.embed_tokens
        self._rotary = decoder.rotary_emb
        self._norm = (decoder.norm.weight, float(decoder.norm.variance_epsilon))
        head = model.get_output_embeddings()
        self._head = _linear_of(head)
        self._layers = [_read_layer(layer, kind) for layer, kind in zip(decoder.layers, layer_types, strict=True)]
        self._on_cpu = decoder.norm.weight.device.type == "cpu"
        self._scripted = ScriptedSteps()
        self._compiled: CompiledSteps | None = None

    def splits(self, queries: int, earlier_keys: int) -> bool:
        """Whether a block of `queries` over `earlier_keys` keys of an unbounded cache, all full attention, is
        better handed `OVER_HISTORY` than its mask (module docstring)."""
        return self._on_cpu and queries > 1 and queries * earlier_keys >= SPLIT_MIN_PAIRS

    @property
    def compiled(self) -> bool:
        """Whether blocks of up to `COMPILED_MAX_QUERIES` queries run compiled spans (`compile_steps`)."""
        return self._compiled is not None

    def compile_steps(self) -> float:
        """Run blocks of up to `COMPILED_MAX_QUERIES` queries through spans compiled by `torch.compile`, compiled
        here, by a forward of one query and one of two (the two graphs of each span), so that no request waits for
        them; returns the seconds that took. Raises what compilation raises, and the forward then stays scripted."""
        steps = CompiledSteps()
        device = self._norm[0].device
        started = time.perf_counter()
        with torch.inference_mode():  # as every forward of the verifier runs, which the graphs' guards check
            for queries in (1, 2):
                input_ids = torch.zeros((1, queries), dtype=torch.long, device=device)  # [1, n]
                positions = torch.arange(queries, device=device)[None]  # [1, n]
                self._run(steps, input_ids, positions, None, _own_keys, 1, ())
        self._compiled = steps
        return time.perf_counter() - started

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        masks: Masks,
        stage: Stage,
        logits_to_keep: int | torch.Tensor,
        feature_layers: Sequence[int],
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Logits [B, kept, V] of the rows `logits_to_keep` selects (as transformers' `logits_to_keep`) and the
        features of `feature_layers` [B, n, H] (what `features.layer_outputs` records), for a block whose layers
        stage their K/V through `stage(layer, k, v) -> (keys, values)`. `masks` is what transformers' attention
        would be given: a boolean mask [B, 1, n, K], one per layer type, or None for a causal block that reads
        only itself or a single query; or `OVER_HISTORY` where `splits` says so."""
        out = self._run(self._steps(input_ids), input_ids, position_ids, masks, stage, logits_to_keep, feature_layers)
        assert out is not None
        return out

    def stage_layers(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, masks: Masks, stage: Stage, last_layer: int
    ) -> None:
        """Layers `0..last_layer` of the block, each staging its K/V through `stage`; the forward stops after the
        last one's staging (no attention there, no later layer, no logits)."""
        self._run(self._steps(input_ids), input_ids, position_ids, masks, stage, 1, (), last_layer=last_layer)

    def _steps(self, input_ids: torch.Tensor) -> LayerSteps:
        if self._compiled is not None and input_ids.shape[1] <= COMPILED_MAX_QUERIES:
            return self._compiled
        return self._scripted

    def _run(
        self,
        steps: LayerSteps,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        masks: Masks,
        stage: Stage,
        logits_to_keep: int | torch.Tensor,
        feature_layers: Sequence[int],
        last_layer: int | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
        """The forward (see `__call__`); with `last_layer`, only up to that layer's staging (None)."""
        hidden = self._embed(input_ids)  # [B, n, H]
        cos, sin = self._rotary(hidden, position_ids)  # [B, n, D]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        features: dict[int, torch.Tensor] = {}
        layers = self._layers
        last = len(layers) - 1
        q, k, v = steps.first(hidden, layers[0].inputs, layers[0].head_dim, cos, sin)
        for index, layer in enumerate(layers):
            parts = stage(index, k, v)
            if index == last_layer:
                return None
            mask = masks[layer.kind] if isinstance(masks, Mapping) else masks
            attended = _attend_parts(q, parts, mask, layer)
            if index == last:  # under the final norm
                hidden = steps.last(hidden, attended, layer.output, layer.head_dim, self._norm)
            else:
                following = layers[index + 1]
                hidden, (q, k, v) = steps.between(
                    hidden, attended, layer.output, layer.head_dim, following.inputs, following.head_dim, cos, sin
                )
            if index in feature_layers:
                features[index] = hidden
        logits = linear(slice_logits_to_keep(hidden, logits_to_keep), *self._head)
        return logits, features


def _own_keys(layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[KeyPart[torch.Tensor], ...]:
    """The staging of a block that reads only itself."""
    return ((keys, values),)


def _attend_parts(q: torch.Tensor, staged: Staged, mask: torch.Tensor | str | None, layer: _Layer) -> torch.Tensor:
    """Attention over a layer's keys in parts: dense parts joined and read by SDPA (`_attend`), as one tensor;
    where a part is held compactly, part by part (`attend_parts`), with the mask as booleans over every key (a
    packed batched forward's rows each over their own keys and part of the mask)."""
    rows = staged if isinstance(staged, list) else [RowKeys(0, int(q.shape[2]), 0, staged)]
    parts = [part for row in rows for part in row.parts]
    if all(isinstance(part, tuple) for part in parts):
        dense: list[Any] = parts
        if len(dense) == 1:
            return _attend(q, dense[0][0], dense[0][1], mask, layer)
        keys, values = torch.cat([k for k, _ in dense], dim=2), torch.cat([v for _, v in dense], dim=2)
        return _attend(q, keys, values, mask, layer)
    if isinstance(mask, str) or (mask is None and q.shape[2] > 1):
        raise ValueError("attention over held keys needs the block's mask")
    allowed = None if mask is None else (mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0)
    outputs = []
    for row in rows:
        count = sum(part[0].shape[2] if isinstance(part, tuple) else part.length for part in row.parts)
        keys_of_row = slice(row.key_start, row.key_start + count)
        columns = None if allowed is None else allowed[row.query_start : row.query_end, keys_of_row]
        row_q = q[:, :, row.query_start : row.query_end]
        outputs.append(attend_parts(row_q, row.parts, columns, scale=layer.scaling))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def _attend_over_history(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layer: _Layer) -> torch.Tensor:
    """Attention of a block of n queries [B, heads, n, D] over K keys whose first K - n every query reads and whose
    last n are the block's own, read causally: the two parts' outputs weighted by their share of the softmax's sum
    (from each part's log-sum-exp)."""
    batch, heads, n, dim = q.shape
    earlier = keys.shape[2] - n
    if earlier <= 0:
        raise ValueError("a block attended over its history needs keys before its own")
    # each K/V head's query heads one after another, as rows of one query block (no mask tells them apart)
    grouped = q.reshape(batch, heads // layer.groups, layer.groups * n, dim)
    past, past_lse = _flash_cpu(grouped, keys[:, :, :earlier], values[:, :, :earlier], scale=layer.scaling)
    own_keys, own_values = keys[:, :, earlier:], values[:, :, earlier:]
    if layer.groups > 1:
        own_keys, own_values = repeat_kv(own_keys, layer.groups), repeat_kv(own_values, layer.groups)
    own, own_lse = _flash_cpu(q, own_keys, own_values, is_causal=True, scale=layer.scaling)
    past_lse, own_lse = past_lse.reshape(batch, heads, n, 1), own_lse.reshape(batch, heads, n, 1)
    top = torch.maximum(past_lse, own_lse)
    past_weight, own_weight = torch.exp(past_lse - top), torch.exp(own_lse - top)
    merged = past.reshape(batch, heads, n, dim).float() * past_weight + own.float() * own_weight
    return (merged / (past_weight + own_weight)).to(q.dtype)


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | str | None, layer: _Layer
) -> torch.Tensor:
    """SDPA over one layer's keys, with transformers' choice of how grouped K/V heads meet the query heads, except
    that a masked block of several queries on a CPU reads the grouped heads in place: PyTorch's CPU flash kernel
    takes a mask and grouped heads together, with the same arithmetic as over repeated heads, and repeating the
    K/V of a long history costs a copy of it per layer (transformers repeats them wherever a mask is given, since
    CUDA's kernels fall back to the math kernel there)."""
    if isinstance(mask, str):
        return _attend_over_history(q, keys, values, layer)
    n = q.shape[2]
    gqa = False
    if layer.groups > 1:
        if use_gqa_in_sdpa(mask, keys, values):
            gqa = True
        elif n == 1:  # the query heads of each K/V head side by side; a mask here is one for every head
            q = q.reshape(q.shape[0], q.shape[1] // layer.groups, layer.groups, q.shape[-1])
        elif q.device.type == "cpu":
            gqa = True
        else:
            keys, values = repeat_kv(keys, layer.groups), repeat_kv(values, layer.groups)
    causal = n > 1 and mask is None
    if causal and keys.shape[2] > n:
        raise ValueError("a causal block over earlier keys needs its mask")
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=layer.scaling, is_causal=causal, enable_gqa=gqa
    )


def _linear_of(module: Any) -> Linear:
    if isinstance(module, PackedLinear):
        return (module.weight, module.bias, module.qparams, module.kind, module.group)
    return (module.weight, module.bias, None, DENSE, 0)


def _read_layer(layer: Any, kind: str) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    head_eps = float(q_norm.variance_epsilon) if q_norm is not None else 0.0
    norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
    inputs = (
        norm_in.weight,
        float(norm_in.variance_epsilon),
        _linear_of(attn.q_proj),
        _linear_of(attn.k_proj),
        _linear_of(attn.v_proj),
        None if q_norm is None else q_norm.weight,
        None if k_norm is None else k_norm.weight,
        head_eps,
    )
    output = (
        _linear_of(attn.o_proj),
        norm_post.weight,
        float(norm_post.variance_epsilon),
        _linear_of(mlp.gate_proj),
        _linear_of(mlp.up_proj),
        _linear_of(mlp.down_proj),
    )
    return _Layer(inputs, output, kind, int(attn.num_key_value_groups), int(attn.head_dim), float(attn.scaling))
