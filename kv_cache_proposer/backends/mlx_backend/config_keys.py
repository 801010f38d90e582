"""The config keys mlx-lm's model classes read that a transformers 5 `config.json` spells differently.

transformers 5 writes RoPE settings under `rope_parameters`; mlx-lm 0.32 reads `rope_theta` / `rope_scaling` (and
Gemma 3's `rope_local_base_freq` and `sliding_window_pattern`) and silently falls back to its own defaults when they
are missing. No MLX import, so converters can use it without loading MLX.
"""

from __future__ import annotations

from typing import Any


class ConfigKeysError(ValueError):
    """The config holds a setting mlx-lm's keys cannot express."""


def mlx_config_keys(config: dict[str, Any]) -> dict[str, Any]:
    """The keys to add to `config` (none that it already has) so mlx-lm reads the settings transformers meant."""
    extra: dict[str, Any] = {}
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "full_attention" in rope:
        full, sliding = rope["full_attention"], rope.get("sliding_attention", {})
        extra["rope_theta"] = full["rope_theta"]
        if "rope_theta" in sliding:
            extra["rope_local_base_freq"] = sliding["rope_theta"]
        if full.get("rope_type", "default") != "default":
            extra["rope_scaling"] = full
    elif isinstance(rope, dict) and "rope_theta" in rope:
        extra["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            extra["rope_scaling"] = rope
    if config.get("model_type") == "gemma3_text" and "layer_types" in config:
        extra["sliding_window_pattern"] = sliding_window_pattern(config["layer_types"])
    return {key: value for key, value in extra.items() if key not in config}


def sliding_window_pattern(layer_types: list[str]) -> int:
    """The period p such that layer i is full attention exactly when i % p == p - 1."""
    for period in range(1, len(layer_types) + 1):
        if all((kind == "full_attention") == (i % period == period - 1) for i, kind in enumerate(layer_types)):
            return period
    raise ConfigKeysError(f"layer_types {layer_types} have no period mlx-lm's sliding_window_pattern can express")
