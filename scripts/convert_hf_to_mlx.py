"""Convert a local Hugging Face checkpoint directory into an mlx-lm model directory that `--backend mlx` serves.

The weights go through mlx-lm's own loader and writer: `mlx_lm.utils.load_model` builds the architecture's mlx-lm
model class and applies its `sanitize` (renamed, fused or dropped tensors), and `mlx_lm.utils.save_model` /
`save_config` write the directory in mlx-lm's format. `mlx_lm.convert` itself is not called because it insists on
loading a tokenizer, and a checkpoint driven only through token ids may have none; tokenizer files that are present
are copied unchanged.

Where transformers 5 writes a config key differently from what mlx-lm's model classes read, the converted config
also carries the key mlx-lm reads (the original keys stay):
- `rope_parameters` -> `rope_theta` and, for non-default RoPE, `rope_scaling`; for per-layer-type RoPE
  (Gemma 3) the full-attention values plus `rope_local_base_freq` from the sliding-attention ones;
- Gemma 3's `layer_types` -> `sliding_window_pattern` (mlx-lm places the full-attention layers by a period);
  a layer list with no such period is refused.

Usage:
    python scripts/convert_hf_to_mlx.py HF_DIR MLX_DIR [--dtype auto|float32|bfloat16|float16] [--force]

    HF_DIR   local Hugging Face checkpoint (config.json + safetensors [+ tokenizer files])
    MLX_DIR  output directory; must not exist unless --force
    --dtype  weight dtype to write (auto: as stored in HF_DIR)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from kv_cache_proposer.backends.mlx_backend import config_keys

COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
DTYPES = ("auto", "float32", "bfloat16", "float16")


class ConversionError(ValueError):
    """The checkpoint cannot be converted; the message says why."""


def mlx_config_keys(config: dict[str, Any]) -> dict[str, Any]:
    """The config keys mlx-lm's model classes read that a transformers 5 config spells differently."""
    try:
        return config_keys.mlx_config_keys(config)
    except config_keys.ConfigKeysError as exc:
        raise ConversionError(str(exc)) from None


def convert(hf_dir: Path, mlx_dir: Path, *, dtype: str = "auto", force: bool = False) -> Path:
    """Write the mlx-lm model directory for `hf_dir` to `mlx_dir` and return it."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import load_model, save_config, save_model

    if dtype not in DTYPES:
        raise ConversionError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{hf_dir} is not a model directory: config.json is missing")
    if mlx_dir.exists():
        if not force:
            raise ConversionError(f"{mlx_dir} exists; pass --force to replace it")
        shutil.rmtree(mlx_dir)
    hf_config = json.loads(config_path.read_text())
    try:
        model, config = load_model(hf_dir, lazy=True, model_config=mlx_config_keys(hf_config))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConversionError(f"mlx-lm cannot load {hf_dir}: {exc}") from exc
    if dtype != "auto":
        target = getattr(mx, dtype)
        allowed = getattr(model, "cast_predicate", lambda _: True)
        model.update(
            tree_map_with_path(
                lambda name, v: v.astype(target) if allowed(name) and mx.issubdtype(v.dtype, mx.floating) else v,
                model.parameters(),
            )
        )
        config["dtype"] = dtype
    save_model(mlx_dir, model, donate_model=True)
    save_config(config, config_path=mlx_dir / "config.json")
    for name in COPIED_FILES:
        if (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, mlx_dir / name)
    return mlx_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", type=Path, help="local Hugging Face checkpoint directory")
    parser.add_argument("mlx_dir", type=Path, help="output mlx-lm model directory")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="weight dtype to write (default: as stored)")
    parser.add_argument("--force", action="store_true", help="replace MLX_DIR if it exists")
    args = parser.parse_args(argv)
    try:
        out = convert(args.hf_dir, args.mlx_dir, dtype=args.dtype, force=args.force)
    except ConversionError as exc:
        print(f"convert_hf_to_mlx: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
