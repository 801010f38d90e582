"""GGUF files turned into model directories both backends load: weights dequantized to float32 safetensors, the
config, the tokenizer with its chat template, and a generation config, all read from the file's own metadata."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The GGUF architectures served: each is converted by transformers' GGUF mapping and run by both backends.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A GGUF file that cannot be served: unreadable, truncated, or of an unsupported architecture or tensor type."""


@dataclass(frozen=True, slots=True)
class GGUFSummary:
    """What a GGUF file holds, read from its header before any tensor is converted."""

    architecture: str
    tensor_types: tuple[str, ...]
    key_length: int | None = None  # `<arch>.attention.key_length`: the attention head size, where the file states it


def inspect_gguf(path: Path) -> GGUFSummary:
    """Read `path`'s header and check it can be converted; raises GGUFError naming what is wrong."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import _type_traits

    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise GGUFError(f"cannot read {path}: {exc.strerror}") from None
    if magic != _MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # a short file fails here, in numpy's views past its end
        raise GGUFError(f"cannot read {path} as a GGUF file (truncated or damaged?): {exc}") from None
    field = reader.fields.get("general.architecture")
    if field is None:
        raise GGUFError(f"{path} names no architecture (general.architecture is missing)")
    architecture = bytes(field.parts[field.data[0]]).decode("utf-8")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path}: architecture {architecture!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    dequantizable = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    types = sorted({t.tensor_type.name for t in reader.tensors})
    unsupported = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in dequantizable})
    if unsupported:
        raise GGUFError(f"{path}: tensor type(s) {', '.join(unsupported)} cannot be dequantized")
    key_length = reader.fields.get(f"{architecture}.attention.key_length")
    return GGUFSummary(
        architecture=architecture,
        tensor_types=tuple(types),
        key_length=int(key_length.parts[key_length.data[0]][0]) if key_length is not None else None,
    )


def convert_gguf(path: Path, out_dir: Path) -> GGUFSummary:
    """Write the model directory of the GGUF file `path` into `out_dir` (created; expected empty).

    Weights are dequantized to float32 and renamed to the transformers layout (Llama's rotary permutation of the
    query and key rows undone); a tied LM head stays tied. Raises GGUFError when the file cannot be served.
    """
    summary = inspect_gguf(path)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        parsed = load_gguf_checkpoint(str(path), return_tensors=False)
        settings = dict(parsed["config"])
        model_type = settings.pop("model_type")
        settings.pop("_model_name_or_path", None)
        if summary.key_length is not None:
            # transformers maps the head size only for some architectures; Qwen3's config would default it to 128.
            settings.setdefault("head_dim", summary.key_length)
        config = AutoConfig.for_model(model_type, **settings)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise GGUFError(f"cannot convert {path}: {type(exc).__name__}: {exc}") from None
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(tensors))
    if missing:
        raise GGUFError(f"{path} lacks {len(missing)} weight(s) the model needs, e.g. {', '.join(missing[:3])}")
    shapes = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    misshapen = [name for name in sorted(expected) if tuple(tensors[name].shape) != shapes[name]]
    if misshapen:
        name = misshapen[0]
        raise GGUFError(
            f"{path}: {len(misshapen)} weight(s) do not have the shape its metadata implies, e.g. {name} is "
            f"{tuple(tensors[name].shape)}, not {shapes[name]}"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {name: tensors[name].to(torch.float32).contiguous() for name in sorted(expected)}
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _write_json(out_dir / "generation_config.json", _generation_config(config))
    log.info(
        "converted GGUF file",
        extra={"source": str(path), "architecture": summary.architecture, "tensor_types": list(summary.tensor_types)},
    )
    return summary


def _generation_config(config: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"_from_model_config": True}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, name, None)
        if value is not None:
            out[name] = value
    return out


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
