"""Tiny random checkpoints of real architectures, saved to disk and loaded through the real loading path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, PretrainedConfig, Qwen3Config

VOCAB_SIZE = 128

COMMON_SHAPE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# Initialiser scales chosen so that greedy decoding of each random model is not a single repeated token.
ARCHITECTURES: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen3": lambda: Qwen3Config(head_dim=16, initializer_range=0.2, **COMMON_SHAPE),
    "llama": lambda: LlamaConfig(initializer_range=0.02, **COMMON_SHAPE),
    "gemma3": lambda: Gemma3TextConfig(
        head_dim=16,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        initializer_range=0.03,
        **COMMON_SHAPE,
    ),
}


def save_checkpoint(arch: str, directory: Path, seed: int = 0) -> Path:
    """Build a seeded random model of `arch` and save it as a Hugging Face checkpoint directory."""
    config = ARCHITECTURES[arch]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory


def save_draft_model(directory: Path, seed: int = 1) -> Path:
    """A smaller random Llama with the same vocabulary as the test checkpoints, for the draft_model proposer."""
    config = LlamaConfig(**{**COMMON_SHAPE, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory


def save_dflash_drafter(
    directory: Path,
    *,
    block_size: int = 4,
    seed: int = 2,
    layers: int = 1,
    sliding_window: int | None = None,
    every_layer_windowed: bool = False,
    attention_bias: bool = False,
) -> Path:
    """A random DFlash drafter in the published format for the test checkpoints (hidden 64, 3 verifier layers).

    `sliding_window`: its even layers attend over that window (the odd ones over everything), or every layer with
    `every_layer_windowed`; `attention_bias`: its Q/K/V/O projections have biases."""
    from kv_cache_proposer.proposers.dflash.checkpoint import save_drafter
    from kv_cache_proposer.proposers.dflash.config import DFlashSpec
    from kv_cache_proposer.proposers.dflash.model import DFlashDrafter

    config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        attention_bias=attention_bias,
    )
    if sliding_window is not None:
        config.sliding_window = sliding_window
        config.layer_types = [
            "sliding_attention" if i % 2 == 0 or every_layer_windowed else "full_attention" for i in range(layers)
        ]
    spec = DFlashSpec(block_size=block_size, target_layer_ids=(0, 2), mask_token_id=VOCAB_SIZE - 1, num_target_layers=3)
    torch.manual_seed(seed)
    save_drafter(DFlashDrafter(config, len(spec.target_layer_ids)), spec, directory)
    return directory


def copy_with_eos(source: Path, target: Path, eos_token_ids: list[int]) -> Path:
    """A copy of checkpoint `source` whose generation config names `eos_token_ids` as its end-of-sequence ids."""
    import json
    import shutil

    shutil.copytree(source, target)
    path = target / "generation_config.json"
    generation_config = json.loads(path.read_text()) if path.exists() else {}
    generation_config["eos_token_id"] = eos_token_ids
    path.write_text(json.dumps(generation_config))
    return target
