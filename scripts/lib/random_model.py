"""A model of a real architecture's shape with random weights, saved as a Hugging Face checkpoint directory with the
bundled model's tokenizer, for measuring speed at a size no bundled model has (the weights' values do not change
the work a forward does)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from inference_engine.model_source import BUNDLED_MODEL_DIR

# Qwen2-0.5B's published shape; `tiny` keeps its structure (grouped K/V heads, biased Q/K/V projections, tied
# embeddings) at a size a CPU builds in a second.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151_936,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=0,  # the tokenizer's
        tie_word_embeddings=True,
    ),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save_random_qwen2(directory: Path, shape: str, *, max_positions: int = 65_536, seed: int = 0) -> Path:
    """A random-weight Qwen2 of `shape` (one of `SHAPES`) in `directory`, float32, with the bundled model's tokenizer
    (its ids are a subset of the vocabulary); `max_positions` is its context."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR, local_files_only=True)
    sizes = dict(SHAPES[shape])
    sizes["vocab_size"] = max(sizes["vocab_size"], len(tokenizer))
    config = Qwen2Config(
        **sizes,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    for name in _TOKENIZER_FILES:
        shutil.copy(BUNDLED_MODEL_DIR / name, directory / name)
    return directory
