"""A byte-level BPE tokenizer for the tiny test checkpoints (vocabulary 128), saved into a directory of its own.

Token 0 is the end-of-sequence token; then space, newline and the 94 printable ASCII characters as byte-level
symbols; then merges of common JSON and English pairs up to the vocabulary size. Bytes outside that set have no
token, so a grammar that needs one reaches a dead end.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.checkpoints import VOCAB_SIZE

EOS_TOKEN = "<|end|>"
EOS_TOKEN_ID = 0

_MERGES = [
    ("{", '"'), ('"', ":"), ('"', ","), ('"', "}"), ("Ġ", '"'), (":", "Ġ"), (",", "Ġ"),
    ("t", "r"), ("tr", "u"), ("tru", "e"), ("f", "a"), ("fa", "l"), ("fal", "s"), ("fals", "e"),
    ("n", "u"), ("nu", "l"), ("nul", "l"), ("e", "r"), ("i", "n"), ("o", "n"), ("a", "n"), ("t", "h"),
    ("th", "e"), ("r", "e"), ("e", "s"), ("o", "r"), ("a", "t"), ("e", "n"), ("s", "t"), ("a", "r"), ("i", "s"),
]  # fmt: skip


def tokenizer_json() -> dict[str, object]:
    """The tokenizer.json document."""
    vocab: dict[str, int] = {EOS_TOKEN: EOS_TOKEN_ID, "Ġ": 1, "Ċ": 2}
    for byte in range(33, 127):
        vocab[chr(byte)] = len(vocab)
    for left, right in _MERGES:
        vocab[left + right] = len(vocab)
    assert len(vocab) == VOCAB_SIZE, len(vocab)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": EOS_TOKEN_ID,
                "content": EOS_TOKEN,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[left, right] for left, right in _MERGES],
        },
    }


def save_test_tokenizer(directory: Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json (naming the end-of-sequence token) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    config = {"eos_token": EOS_TOKEN, "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
