"""Loading local mlx-lm model directories (never from a hub) and checking that the backend can serve them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from kv_cache_proposer.backends.mlx_backend import layout
from kv_cache_proposer.backends.mlx_backend.config_keys import mlx_config_keys
from kv_cache_proposer.errors import ModelLoadError

DEVICES = ("auto", "cpu", "gpu")

_DTYPES = {
    "float32": mx.float32,
    "fp32": mx.float32,
    "bfloat16": mx.bfloat16,
    "bf16": mx.bfloat16,
    "float16": mx.float16,
    "fp16": mx.float16,
}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """An mlx-lm model in eval mode with what the verifier needs to know about it."""

    model: nn.Module
    model_type: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    dtype: mx.Dtype
    # Per layer: the attention window the model's own cache would enforce (None: the layer attends the whole
    # history). mlx-lm models that rely on a rotating cache for a sliding window need it in the mask instead.
    layer_windows: tuple[int | None, ...]
    # Linear layers and embeddings stored input-major (`layout.input_major`); 0 where mlx-lm's layout is kept.
    input_major_modules: int = 0
    weights: str = "float32"  # the `--weights` choice the model was loaded at


def resolve_device(name: str) -> mx.Device:
    """`auto` picks the GPU (Metal on a Mac) when MLX has one, else the CPU; `gpu` must be available."""
    if name not in DEVICES:
        raise ModelLoadError(f"unknown device {name!r} for the mlx backend; expected one of {', '.join(DEVICES)}")
    has_gpu = bool(mx.is_available(mx.gpu))
    if name == "gpu" and not has_gpu:
        raise ModelLoadError("device 'gpu' requested but this MLX build has no GPU backend")
    if name == "gpu" or (name == "auto" and has_gpu):
        return mx.Device(mx.gpu)
    return mx.Device(mx.cpu)


def resolve_dtype(name: str, device: mx.Device) -> mx.Dtype | None:
    """`auto` is float32 on the CPU and the stored dtype of the weights on the GPU (None: keep them as stored)."""
    if name == "auto":
        return mx.float32 if device.type == mx.cpu else None
    try:
        return _DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {name!r}; expected one of {', '.join(sorted(_DTYPES))}") from None


def load_mlx_model(
    model_dir: str | Path, dtype: mx.Dtype | None, *, input_major: bool = False, weights: str = "float32"
) -> LoadedModel:
    """Load an mlx-lm model directory (config.json + safetensors) through mlx-lm's own loader; `weights` int8 or
    int4 quantizes its linear layers and embeddings at load (`quantize_weights`); `input_major` lays the layers
    left unquantized out for CPU matrix products (`layout.input_major`)."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a model directory: config.json is missing")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} holds no weights (*.safetensors)")
    from mlx_lm.utils import load_model

    try:
        # A transformers 5 config spells RoPE settings as mlx-lm does not read them; mlx-lm would use its defaults.
        model, config = load_model(path, model_config=mlx_config_keys(json.loads((path / "config.json").read_text())))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot load {path} as an mlx-lm model: {exc}") from exc
    if dtype is not None:
        _cast(model, dtype)
    if weights in QUANTIZED_BITS:
        quantize_weights(model, weights)
    elif weights != "float32":
        raise ModelLoadError(
            f"--weights {weights} is not available on the MLX backend (float32, int8, int4; "
            "--dtype bfloat16 holds the whole model in bfloat16)"
        )
    replaced = layout.input_major(model) if input_major else 0
    num_layers = len(model.layers)
    return LoadedModel(
        model=model,
        model_type=str(config.get("model_type", "unknown")),
        vocab_size=_vocab_size(config, path),
        num_layers=num_layers,
        hidden_size=int(config.get("hidden_size") or config.get("text_config", {}).get("hidden_size", 0)),
        dtype=_floating_dtype(model),
        layer_windows=_layer_windows(model, num_layers, path),
        input_major_modules=replaced,
        weights=weights,
    )


# `--weights` choice -> bits of the layers and of the embedding / LM head (8: a 4-bit head moves a small model's
# answers, as on the torch backend), in mlx's affine groups of 32 (a GGUF Q4_1 block's layout).
QUANTIZED_BITS = {"int8": (8, 8), "int4": (4, 8)}
QUANTIZED_GROUP = 32


def quantize_weights(model: nn.Module, weights: str) -> None:
    """Quantize `model`'s linear layers and embeddings in place with mlx's affine quantization; a module whose
    input size does not fill groups of 32 stays as it is."""
    layer_bits, head_bits = QUANTIZED_BITS[weights]

    def choose(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if not hasattr(module, "to_quantized"):
            return False
        width = module.weight.shape[-1]
        if width % QUANTIZED_GROUP:
            return False
        head = isinstance(module, nn.Embedding) or path.endswith("lm_head")
        return {"group_size": QUANTIZED_GROUP, "bits": head_bits if head else layer_bits, "mode": "affine"}

    nn.quantize(model, class_predicate=choose)
    mx.eval(model.parameters())


def _cast(model: nn.Module, dtype: mx.Dtype) -> None:
    # The same rule as mlx-lm's converter: floating parameters only, and only those the model allows.
    allowed = getattr(model, "cast_predicate", lambda _: True)

    def cast(name: str, value: mx.array) -> mx.array:
        if allowed(name) and mx.issubdtype(value.dtype, mx.floating):
            return value.astype(dtype)
        return value

    model.update(tree_map_with_path(cast, model.parameters()))
    mx.eval(model.parameters())


def _floating_dtype(model: nn.Module) -> mx.Dtype:
    parameters = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    for _, value in parameters:
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.float32


def _vocab_size(config: dict[str, Any], path: Path) -> int:
    value = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{path}/config.json names no vocab_size")
    return value


def _layer_windows(model: nn.Module, num_layers: int, path: Path) -> tuple[int | None, ...]:
    """The attention window of each layer, read from the caches the model would make for itself.

    Only plain and rotating K/V caches describe attention the session cache can take over; any other state
    (recurrent layers, chunked attention, kept sink tokens) is refused before serving anything.
    """
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    if not hasattr(model, "make_cache"):
        return (None,) * num_layers
    windows: list[int | None] = []
    for index, native in enumerate(model.make_cache()):
        if type(native) is KVCache:
            windows.append(None)
        elif type(native) is RotatingKVCache and native.keep == 0:
            windows.append(int(native.max_size))
        else:
            raise ModelLoadError(
                f"{path}: layer {index} keeps {type(native).__name__} state; the mlx backend serves models whose "
                "layers all use plain or sliding-window attention"
            )
    if len(windows) != num_layers:
        raise ModelLoadError(f"{path}: the model makes {len(windows)} caches for {num_layers} layers")
    return tuple(windows)
