"""Capturing an mlx-lm model's hidden states during the verifier's own forwards.

The feature of layer i follows transformers' `hidden_states[i + 1]` convention, as on the PyTorch backend: the
output of decoder layer i, except for the last layer, whose feature is the final norm's output. mlx-lm models call
their decoder layers in order from `model.layers` and the final norm as `norm` of the inner model; a `LayerTap`
wraps one of those modules and keeps its outputs while recording. Taps are installed only for the layers a proposer
asks for, so other models and layers run untouched.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn


class Recording:
    """Outputs kept by a tap; a plain object, so MLX never mistakes them for parameters."""

    def __init__(self) -> None:
        self.outputs: list[mx.array] | None = None


class LayerTap(nn.Module):
    """A decoder layer that also keeps what it returns while its recording is on."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.recording = Recording()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.layer(*args, **kwargs)
        if self.recording.outputs is not None:
            self.recording.outputs.append(out[0] if isinstance(out, tuple) else out)
        return out

    def __getattr__(self, name: str) -> Any:
        # Model code reads attributes of its layers (e.g. whether one uses a sliding window): answer for the layer.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "layer" not in self:
                raise
            return getattr(self["layer"], name)


def tap_layers(model: nn.Module, layer_ids: Sequence[int]) -> list[LayerTap]:
    """The taps of `layer_ids`, installing the missing ones (in the layer list, or on the final norm)."""
    layers = model.layers
    inner = getattr(model, "model", None) or getattr(model, "language_model", None)
    norm_owner = inner if inner is not None and "norm" in inner else None
    taps = []
    for index in layer_ids:
        if index == len(layers) - 1 and norm_owner is not None:
            if not isinstance(norm_owner["norm"], LayerTap):
                norm_owner.norm = LayerTap(norm_owner["norm"])
            taps.append(norm_owner["norm"])
            continue
        if not isinstance(layers[index], LayerTap):
            layers[index] = LayerTap(layers[index])
        taps.append(layers[index])
    return taps


@contextmanager
def recording(model: nn.Module, layer_ids: Sequence[int]) -> Iterator[list[LayerTap]]:
    """The taps of `layer_ids` (none for no layers), keeping every output of their layers inside the block."""
    taps = tap_layers(model, layer_ids) if layer_ids else []
    for tap in taps:
        tap.recording.outputs = []
    try:
        yield taps
    finally:
        for tap in taps:
            tap.recording.outputs = None


def recorded_features(taps: Sequence[LayerTap]) -> mx.array:
    """What the taps kept, one row per position [positions, L*H]: each tap's outputs [1, part, H], in call order."""
    parts = [mx.concatenate(tap.recording.outputs or [], axis=1)[0] for tap in taps]
    return mx.concatenate(parts, axis=-1)
