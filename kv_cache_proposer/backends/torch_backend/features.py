"""Capturing decoder-layer outputs of a transformers model during a forward, through forward hooks.

The outputs are the residual stream after each chosen decoder layer, exactly; transformers' own
`output_hidden_states` differs for the last layer, whose entry has the final norm applied.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import PreTrainedModel


@contextmanager
def layer_outputs(model: PreTrainedModel, layer_ids: Sequence[int]) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Within the block, every forward appends each chosen layer's output [B, T, H] to `outputs[layer]`."""
    layers = model.get_decoder().layers
    outputs: dict[int, list[torch.Tensor]] = {index: [] for index in layer_ids}

    def hook(index: int) -> Any:
        def record(module: torch.nn.Module, args: Any, output: Any) -> None:
            outputs[index].append(output[0] if isinstance(output, tuple) else output)

        return record

    handles = [layers[index].register_forward_hook(hook(index)) for index in layer_ids]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def concatenated(outputs: dict[int, list[torch.Tensor]], layer_ids: Sequence[int]) -> torch.Tensor:
    """The last recorded output of each layer, concatenated along the hidden dimension [B, T, L*H]."""
    return torch.cat([outputs[index][-1] for index in layer_ids], dim=-1)
