"""Tiny GGUF files written as llama.cpp's converter writes them, from the tiny random test checkpoints.

`write_gguf` takes a Llama or Qwen3 checkpoint directory and writes the architecture metadata, the byte-level BPE
tokenizer of `tests/support/tokenizers.py` with a chat template, and the weights under llama.cpp's tensor names: the
query and key rows of Llama permuted for llama.cpp's rotary layout, norms in F32 and matrices in the chosen type.
`stored_weights` gives the checkpoint's weights as a reader of that file should get them back (rounded to F16, or
quantized and dequantized), the exact reference for a conversion.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.support.tokenizers import EOS_TOKEN_ID, tokenizer_json

# Matrix types a test file may hold; norms stay F32 as llama.cpp keeps them.
TENSOR_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
}
# Hugging Face module name inside `model.layers.N.` -> llama.cpp tensor name inside `blk.N.`.
_BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The float32 weights of a saved checkpoint, by Hugging Face name (a tied LM head is not among them)."""
    return {name: t.to(torch.float32) for name, t in load_file(str(checkpoint / "model.safetensors")).items()}


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for the Hugging Face weight `hf_name`."""
    module, suffix = hf_name.rsplit(".", 1)
    if module in _TOP_NAMES:
        return f"{_TOP_NAMES[module]}.{suffix}"
    parts = module.split(".", 3)  # model, layers, N, the module inside the block
    if len(parts) != 4 or parts[:2] != ["model", "layers"] or parts[3] not in _BLOCK_NAMES:
        raise ValueError(f"no llama.cpp name for {hf_name}")
    return f"blk.{parts[2]}.{_BLOCK_NAMES[parts[3]]}.{suffix}"


def rotary_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Llama's query/key rows reordered as llama.cpp stores them: within each head, the rotary halves
    (first half, second half) become interleaved pairs."""
    rows = weight.shape[0]
    # [n_head, 2 halves, head_dim/2, in] -> [n_head, head_dim/2, 2, in]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _stored(weight: np.ndarray, tensor_type: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """The array the file holds for `weight` and its raw type (None: numpy's dtype names it)."""
    if weight.ndim == 1 or tensor_type == "F32":
        return weight.astype(np.float32), None
    if tensor_type == "F16":
        return weight.astype(np.float16), None
    qtype = gguf.GGMLQuantizationType[tensor_type]
    return gguf.quants.quantize(weight.astype(np.float32), qtype), qtype


def stored_weights(weights: dict[str, torch.Tensor], tensor_type: str) -> dict[str, torch.Tensor]:
    """`weights` as a file of `tensor_type` holds them, read back to float32: the exact values a faithful conversion
    yields (quantization works on rows, so it commutes with Llama's row permutation)."""
    out = {}
    for name, tensor in weights.items():
        data, qtype = _stored(tensor.numpy(), tensor_type)
        values = data.astype(np.float32) if qtype is None else gguf.quants.dequantize(data, qtype)
        out[name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(tensor.shape)
    return out


def save_stored_checkpoint(checkpoint: Path, tensor_type: str, directory: Path) -> Path:
    """A copy of `checkpoint` whose weights are rounded as a GGUF file of `tensor_type` stores them."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (checkpoint / name).exists():
            (directory / name).write_bytes((checkpoint / name).read_bytes())
    rounded = stored_weights(checkpoint_weights(checkpoint), tensor_type)
    save_file(rounded, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def write_gguf(
    checkpoint: Path,
    path: Path,
    tensor_type: str = "F32",
    *,
    architecture: str | None = None,
    raw_types: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """Write the Llama or Qwen3 `checkpoint` as the GGUF file `path` with matrices of `tensor_type`.

    `architecture` overrides the architecture the file states (its metadata keys follow it); `raw_types` stores the
    named GGUF tensors as zero bytes of another type, for files a reader cannot dequantize."""
    config = json.loads((checkpoint / "config.json").read_text())
    model_type = config["model_type"]
    if model_type not in ("llama", "qwen3"):
        raise ValueError(f"write_gguf writes llama and qwen3 checkpoints, not {model_type}")
    arch = architecture or model_type
    n_head, n_head_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny random {model_type}")
    writer.add_file_type(_FILE_TYPES[tensor_type])
    if tensor_type not in ("F32", "F16"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if model_type == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    _add_tokenizer(writer, config["vocab_size"])

    raw_types = raw_types or {}
    for hf_name, tensor in checkpoint_weights(checkpoint).items():
        name = gguf_tensor_name(hf_name)
        weight = tensor.numpy()
        if model_type == "llama" and ".attn_q." in name:
            weight = rotary_permute(weight, n_head)
        elif model_type == "llama" and ".attn_k." in name:
            weight = rotary_permute(weight, n_head_kv)
        if name in raw_types:
            _add_zero_tensor(writer, name, weight.shape, raw_types[name])
            continue
        data, qtype = _stored(weight, tensor_type)
        writer.add_tensor(name, data, raw_dtype=qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _rope_theta(config: dict[str, Any]) -> float:
    rope = config.get("rope_parameters") or {}  # transformers 5 keeps rope_theta there
    return float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)


def _add_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """The test tokenizer as llama.cpp stores a byte-level BPE: tokens in id order, their types, the merges."""
    document = tokenizer_json()
    model = document["model"]
    assert isinstance(model, dict)
    vocab: dict[str, int] = model["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    if len(tokens) != vocab_size:
        raise ValueError(f"the test tokenizer has {len(tokens)} tokens, the checkpoint {vocab_size}")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if i == EOS_TOKEN_ID else gguf.TokenType.NORMAL for i in range(len(tokens))]
    )
    writer.add_token_merges([f"{left} {right}" for left, right in model["merges"]])
    writer.add_bos_token_id(EOS_TOKEN_ID)
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _add_zero_tensor(
    writer: gguf.GGUFWriter, name: str, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType
) -> None:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, columns = shape[0], int(np.prod(shape[1:]))
    data = np.zeros((rows, columns // block_size * type_size), dtype=np.uint8)
    writer.add_tensor(name, data, raw_dtype=qtype)
