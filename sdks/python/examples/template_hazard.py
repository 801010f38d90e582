"""The chat-template re-rendering hazard, and how append-only token deltas avoid it.

A Qwen3-style template with `enable_thinking=False` opens an empty think block in the generation prompt, and when
the conversation has grown it renders earlier assistant turns without it. So re-rendering the whole history each
turn gives a token sequence that is not an extension of what the session already holds: a server that matched
prefixes would have to re-prefill from the first assistant turn on, every turn. `AppendOnlyChat` renders each new
message once and keeps generated tokens as produced; the session's history (read back from the server) always
equals the client's tokens.

The tokenizer is built locally from the bundled model's byte-level tokenizer.json and the Qwen3-style template
next to this file (nothing is downloaded). Run a daemon first (`scripts/serve.sh`), then:

    python sdks/python/examples/template_hazard.py [--address 127.0.0.1:50051] [--turns 3]

Exits 0 when the hazard showed up and every append-only history matched the server's. Needs the tokenization
extra: pip install 'kakeya[tokenization]'.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import kakeya
from kakeya.tokenization import AppendOnlyChat, tokens_for_chat
from transformers import PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent
BUNDLED_MODEL = HERE.parents[2] / "inference_engine" / "models" / "kakeya-tiny"
QUESTIONS = ["What is a KV cache?", "Why keep it on the server?", "What does a turn cost then?", "And a long chat?"]


def build_tokenizer(model_dir: Path) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = (HERE / "qwen3_style_chat_template.jinja").read_text()
    return tokenizer


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model-dir", type=Path, default=BUNDLED_MODEL, help="directory holding tokenizer.json")
    parser.add_argument("--turns", type=int, default=3, choices=range(2, len(QUESTIONS) + 1))
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    tokenizer = build_tokenizer(args.model_dir)
    settings = {"enable_thinking": False}
    chat = AppendOnlyChat(tokenizer, **settings)
    conversation: list[dict[str, str]] = []
    hazards = mismatches = 0
    client = kakeya.Client(args.address, api_key=args.api_key)
    with client, client.create_session(eos_token_ids=[tokenizer.eos_token_id], label="template-hazard") as session:
        for turn, question in enumerate(QUESTIONS[: args.turns]):
            conversation.append({"role": "user", "content": question})
            held = list(chat.tokens)
            rerendered = tokens_for_chat(conversation, tokenizer, **settings)
            if held and rerendered[: len(held)] != held:
                hazards += 1
                at = first_difference(held, rerendered)
                print(
                    f"turn {turn}: re-rendering the history is NOT an extension of the {len(held)} tokens the "
                    f"session holds; they differ from token {at}:\n"
                    f"    session holds: {tokenizer.decode(held[at : at + 16])!r}\n"
                    f"    re-rendered:   {tokenizer.decode(rerendered[at : at + 16])!r}"
                )
            delta = chat.add_messages(conversation[-1:])
            session.append(delta)
            reply = list(session.generate(args.max_tokens))
            chat.add_generated(reply)
            conversation.append(
                {"role": "assistant", "content": str(tokenizer.decode(reply, skip_special_tokens=True))}
            )
            server_history = session.info(history_tail_tokens=len(chat.tokens)).history_tail
            matches = list(server_history) == chat.tokens
            mismatches += not matches
            print(
                f"turn {turn}: appended a delta of {len(delta)} tokens, generated {len(reply)}; the server's "
                f"history of {len(server_history)} tokens {'equals' if matches else 'DIFFERS FROM'} the "
                "append-only sequence"
            )
    print(f"re-rendering hazards: {hazards}; append-only mismatches: {mismatches}")
    return 0 if hazards and not mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
