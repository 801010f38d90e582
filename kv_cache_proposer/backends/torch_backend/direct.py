"""The llama family's forward, run directly over the model's own weights: transformers' operations in transformers'
order on the same tensors, without the Python around them (a decoder layer is its K/V staging and attention
between spans of compute, `layer_steps`). On a CPU, attention and float32 products run in a fixed order whatever the
shape of the block (`exact_attention`, `weights.linear`), so that a token's values do not depend on how its history
was delivered or which sessions share its forward; their values then differ from transformers' by float rounding.
Any other architecture, attention implementation or module layout runs through transformers' modules
(`unsupported` says why). docs/architecture.md ("The decode step") describes both paths and where their values
differ.
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
from kv_cache_proposer.backends.torch_backend.exact_attention import Memo, attend_exact, attend_exact_rows, joined
from kv_cache_proposer.backends.torch_backend.kernel_steps import KernelSteps
from kv_cache_proposer.backends.torch_backend.kernel_steps import serves as kernel_serves
from kv_cache_proposer.backends.torch_backend.layer_steps import (
    CompiledSteps,
    Inputs,
    LayerSteps,
    Linear,
    Output,
    ScriptedSteps,
)
from kv_cache_proposer.backends.torch_backend.weights import (
    DENSE,
    DENSE_EXACT,
    PackedLinear,
    exact_dense,
    linear,
    stack_int4,
)
from kv_cache_proposer.cache.protocol import KeyPart

DIRECT_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

Staged = tuple[KeyPart[torch.Tensor], ...] | list[RowKeys[torch.Tensor]]
"""What a layer's attention reads, in parts (`SessionCache.stage_layer_parts`), or per row of a packed batched
forward (`BatchLayout.stage_layer_rows`)."""
Stage = Callable[[int, torch.Tensor, torch.Tensor], Staged]
"""Stages a layer's K/V and returns what its attention reads."""

# The mask of a block that reads every earlier key, then its own keys causally, left for attention to build
# (`DirectForward.implies_mask`).
OVER_HISTORY: Final = "over history"
Mask = torch.Tensor | Literal["over history"] | None
"""One block's mask: booleans (or additive) `[1, 1, n, K]`, `OVER_HISTORY`, or None (causal over itself alone)."""
Masks = Mask | Mapping[str, torch.Tensor] | list["Masks"]
"""A model call's masks: one for every layer, one per layer type, or (a packed batched forward) a row's own
masks per row, each what that row's block is given alone, so that attention reads each row exactly as it would
read that block alone."""

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

    def __init__(self, model: PreTrainedModel, layer_types: Sequence[str], *, invariant: bool = True) -> None:
        """`invariant`: on a CPU, attention and float32 products in a fixed order whatever a block's shape (the
        module docstring); else the fastest kernels for each shape."""
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"the direct forward cannot serve this model: {reason}")
        decoder: Any = model.get_decoder()
        self._embed = decoder.embed_tokens
        self._rotary = decoder.rotary_emb
        self._norm = (decoder.norm.weight, float(decoder.norm.variance_epsilon))
        self._on_cpu = decoder.norm.weight.device.type == "cpu"
        self._exact = invariant and self._on_cpu
        self._head = _head_of(model.get_output_embeddings(), self._exact)
        self._layers = [
            _read_layer(layer, kind, self._exact) for layer, kind in zip(decoder.layers, layer_types, strict=True)
        ]
        spans = [(layer.inputs, layer.output, layer.head_dim) for layer in self._layers]
        hidden_size = int(decoder.norm.weight.shape[0])
        # int4 layers over quantized rows: each span in one kernel call; else TorchScript's
        self._scripted: LayerSteps = KernelSteps() if kernel_serves(spans, hidden_size) else ScriptedSteps()
        self._compiled: CompiledSteps | None = None

    def implies_mask(self, queries: int) -> bool:
        """Whether a block of `queries` over earlier keys of an unbounded cache, all full attention, may be handed
        `OVER_HISTORY` instead of its mask: where attention builds its padded mask itself."""
        return self._exact and queries > 1

    @property
    def exact(self) -> bool:
        """Whether attention and float32 products run in a fixed order whatever the shape of the block (a CPU)."""
        return self._exact

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
        only itself or a single query; or `OVER_HISTORY` where `implies_mask` says so."""
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
        memo: Memo | None = {} if self._exact else None  # the padded masks of this forward's attention
        for index, layer in enumerate(layers):
            parts = stage(index, k, v)
            if index == last_layer:
                return None
            attended = _attend_staged(q, parts, masks, layer, memo)
            if index == last:  # under the final norm
                hidden = steps.last(hidden, attended, layer.output, layer.head_dim, self._norm)
            else:
                following = layers[index + 1]
                hidden, (q, k, v) = steps.between(
                    hidden, attended, layer.output, layer.head_dim, following.inputs, following.head_dim, cos, sin
                )
            if index in feature_layers:
                features[index] = hidden
        logits = self._head(slice_logits_to_keep(hidden, logits_to_keep))
        return logits, features


def _own_keys(layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[KeyPart[torch.Tensor], ...]:
    """The staging of a block that reads only itself."""
    return ((keys, values),)


def _layer_mask(masks: Masks, layer: _Layer) -> Mask:
    if isinstance(masks, list):
        raise ValueError("per-row masks belong to a packed batched forward's rows")
    return masks[layer.kind] if isinstance(masks, Mapping) else masks


def _attend_staged(q: torch.Tensor, staged: Staged, masks: Masks, layer: _Layer, memo: Memo | None) -> torch.Tensor:
    """A layer's attention over what its staging returned. With per-row masks (a packed batched forward), each
    row's queries attend over that row's keys alone, under the row's own mask, through the same calls as a forward
    of that row's block alone: a row's values do not depend on the rows beside it, and no query scores another
    row's keys."""
    if not isinstance(masks, list):
        return _attend_parts(q, staged, _layer_mask(masks, layer), layer, memo)
    if not isinstance(staged, list) or len(staged) != len(masks):
        raise ValueError("per-row masks need the staging of a packed batched forward, one row each")
    batch, heads, _, dim = q.shape
    together = _attend_rows_together(q, staged, masks, layer, memo)
    if together is not None:
        return together
    outputs = []
    for row, row_masks in zip(staged, masks, strict=True):
        row_q = q[:, :, row.query_start : row.query_end]
        attended = _attend_parts(row_q, row.parts, _layer_mask(row_masks, layer), layer, memo)
        outputs.append(attended.reshape(batch, heads, row.query_end - row.query_start, dim))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def _attend_rows_together(
    q: torch.Tensor, rows: list[RowKeys[torch.Tensor]], masks: list[Masks], layer: _Layer, memo: Memo | None
) -> torch.Tensor | None:
    """The rows of a packed batched forward, each over its own dense keys, in one call of the compiled kernel
    (`attend_exact_rows`: each row's values those of its block alone); None where that kernel would not attend
    every row alone (the rows are then attended one by one)."""
    dense = all(len(row.parts) == 1 and isinstance(row.parts[0], tuple) for row in rows)
    if memo is None or q.shape[0] != 1 or not dense:
        return None
    inputs = []
    for row, row_masks in zip(rows, masks, strict=True):
        part = row.parts[0]
        assert isinstance(part, tuple)
        keys, values = part
        inputs.append((row.query_start, row.query_end, keys, values, _layer_mask(row_masks, layer)))
    return attend_exact_rows(q, inputs, layer.groups, layer.scaling, memo)


def _attend_parts(q: torch.Tensor, staged: Staged, mask: Mask, layer: _Layer, memo: Memo | None) -> torch.Tensor:
    """Attention over a layer's keys in parts: dense parts joined and read by SDPA (`_attend`), as one tensor;
    where a part is held compactly, part by part (`attend_parts`), with the mask as booleans over every key (a
    packed batched forward's rows each over their own keys and part of the mask)."""
    rows = staged if isinstance(staged, list) else [RowKeys(0, int(q.shape[2]), 0, staged)]
    parts = [part for row in rows for part in row.parts]
    if all(isinstance(part, tuple) for part in parts):
        dense: list[Any] = parts
        if len(dense) == 1:
            return _attend(q, dense[0][0], dense[0][1], mask, layer, memo)
        padded = memo is not None
        keys, values = joined([k for k, _ in dense], padded), joined([v for _, v in dense], padded)
        return _attend(q, keys, values, mask, layer, memo)
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


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Mask, layer: _Layer, memo: Memo | None
) -> torch.Tensor:
    """SDPA over one layer's keys: `attend_exact` where the forward keeps a `memo` of its masks; else with
    transformers' choice of how grouped K/V heads meet the query heads, except that a masked block of several
    queries on a CPU reads the grouped heads in place (PyTorch's CPU flash kernel takes a mask and grouped heads
    together, and repeating the K/V of a long history costs a copy of it per layer)."""
    if memo is not None:  # K/V at another precision than the queries included (`attend_exact` meets them there)
        return attend_exact(q, keys, values, mask, layer.groups, layer.scaling, memo)
    if keys.dtype != q.dtype:  # K/V held at another precision (bfloat16): the queries meet them at theirs
        return _attend(q.to(keys.dtype), keys, values, mask, layer, memo).to(q.dtype)
    if isinstance(mask, str):
        raise ValueError("a block over its history is handed its mask without shape-invariant attention")
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


def _linear_of(module: Any, exact: bool) -> Linear:
    """A linear layer's weights as `linear` takes them; `exact`: a float32 weight reordered for a product whose
    rows do not depend on each other (`DENSE_EXACT`; a copy of the weight, held beside the model's)."""
    if isinstance(module, PackedLinear):
        return (module.weight, module.bias, module.qparams, module.kind, module.group)
    reordered = exact_dense(module.weight) if exact else None
    if reordered is not None:
        return (reordered, module.bias, None, DENSE_EXACT, 0)
    return (module.weight, module.bias, None, DENSE, 0)


def _products(modules: tuple[Any, ...], exact: bool) -> list[Linear]:
    """Layers that read the same input as `linear` takes them: one stacked product where that gives every output
    its own values (`stack_int4`: int4 layers), else one per layer."""
    stacked = stack_int4(list(modules))
    return [stacked] if stacked is not None else [_linear_of(module, exact) for module in modules]


def _head_of(module: Any, exact: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The LM head's product: a packed head's own (an int8 head's integer sums may run on the compiled kernel,
    `PackedLinear.forward`), else `linear` over its weights as `_linear_of` holds them."""
    if isinstance(module, PackedLinear):
        return module
    weights = _linear_of(module, exact)
    return lambda x: linear(x, *weights)


def _read_layer(layer: Any, kind: str, exact: bool) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    head_eps = float(q_norm.variance_epsilon) if q_norm is not None else 0.0
    norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    inputs = (
        norm_in.weight,
        float(norm_in.variance_epsilon),
        _products(projections, exact),
        [int(p.out_features) for p in projections],
        None if q_norm is None else q_norm.weight,
        None if k_norm is None else k_norm.weight,
        head_eps,
    )
    output = (
        _linear_of(attn.o_proj, exact),
        norm_post.weight,
        float(norm_post.variance_epsilon),
        _products((mlp.gate_proj, mlp.up_proj), exact),
        _linear_of(mlp.down_proj, exact),
    )
    return _Layer(inputs, output, kind, int(attn.num_key_value_groups), int(attn.head_dim), float(attn.scaling))
