"""Capturing a transformers model's hidden states during a forward, through forward hooks (and running only its
first layers, `first_layers`).

The feature of layer i is what transformers returns as `hidden_states[i + 1]` with `output_hidden_states=True`,
the convention published DFlash drafters are trained on: the residual stream after decoder layer i, except for the
last layer, whose entry is the final norm's output. Hooks capture exactly those tensors from the forward that runs
anyway (for the last layer, the final norm's output), so no second pass and no full hidden-state list is made.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import PreTrainedModel


def feature_module(model: PreTrainedModel, index: int) -> torch.nn.Module:
    """The module whose output is feature `index`: decoder layer `index`, or the final norm for the last layer."""
    decoder = model.get_decoder()
    layers = decoder.layers
    if index == len(layers) - 1:
        norm = getattr(decoder, "norm", None)
        if isinstance(norm, torch.nn.Module):
            return norm
    return layers[index]


@contextmanager
def layer_outputs(model: PreTrainedModel, layer_ids: Sequence[int]) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Within the block, every forward appends each chosen layer's feature [B, T, H] to `outputs[layer]`."""
    outputs: dict[int, list[torch.Tensor]] = {index: [] for index in layer_ids}

    def hook(index: int) -> Any:
        def record(module: torch.nn.Module, args: Any, output: Any) -> None:
            outputs[index].append(output[0] if isinstance(output, tuple) else output)

        return record

    handles = [feature_module(model, index).register_forward_hook(hook(index)) for index in layer_ids]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def concatenated(outputs: dict[int, list[torch.Tensor]], layer_ids: Sequence[int]) -> torch.Tensor:
    """The last recorded output of each layer, concatenated along the hidden dimension [B, T, L*H]."""
    return torch.cat([outputs[index][-1] for index in layer_ids], dim=-1)


@contextmanager
def first_layers(model: PreTrainedModel, count: int) -> Iterator[None]:
    """Within the block, the model's decoder runs its first `count` layers only (the later ones are set aside and
    put back after)."""
    decoder: Any = model.get_decoder()
    layers = decoder.layers
    decoder.layers = torch.nn.ModuleList(list(layers)[:count])
    try:
        yield
    finally:
        decoder.layers = layers
