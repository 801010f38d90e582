"""Write the deterministic placeholder `kakeya-tiny` model: a seeded random Qwen3 and a byte-level tokenizer.

It stands in as the bundled default model until a trained one replaces it: its text is not meaningful, but it is
a real Qwen3 checkpoint in Hugging Face format that loads and decodes through the serving path, byte for byte the
same on every machine.

Usage:
    python scripts/make_placeholder_model.py [--out inference_engine/models/kakeya-tiny] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "inference_engine" / "models" / "kakeya-tiny"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with the 256 byte symbols and no merges, plus chat and mask specials."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(vocab_size: int, eos_token_id: int, seed: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32768,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.1,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output model directory")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = build_model(len(tokenizer), eos_id, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    card = {
        "name": "kakeya-tiny",
        "kind": "placeholder",
        "description": "seeded random Qwen3 weights and a byte-level tokenizer; not trained",
        "seed": args.seed,
        "vocab_size": len(tokenizer),
    }
    (args.out / "kakeya_model.json").write_text(json.dumps(card, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
