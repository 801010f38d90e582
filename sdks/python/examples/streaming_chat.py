"""A streaming chat loop: each user line is appended to one session as an append-only delta, and the reply is
printed token by token as it arrives.

Run a daemon first (`scripts/serve.sh` serves the default model, SmolLM2-135M-Instruct), then, from the repository's
root:

    .venv/bin/python sdks/python/examples/streaming_chat.py [--address 127.0.0.1:50051] [--tokenizer DIR]
    printf 'What is the capital of France?\\nAnd of Italy?\\n' | .venv/bin/python sdks/python/examples/streaming_chat.py

The tokenizer (and chat template) is the served model's: by default the directory `kakeya-runtime prepare-model`
prints, the default model's; pass `--tokenizer DIR` for a daemon serving another model.

Needs the tokenization extra: pip install 'kakeya[tokenization]'.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import kakeya
from kakeya.tokenization import AppendOnlyChat, load_tokenizer


def default_model_dir() -> Path:
    """The directory of the model the daemon serves by default, as `kakeya-runtime prepare-model` prints it."""
    runtime = Path(sys.executable).with_name("kakeya-runtime")
    done = subprocess.run([str(runtime), "prepare-model"], capture_output=True, text=True, check=True)
    return Path(done.stdout.strip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--tokenizer", type=Path, default=None, help="local tokenizer directory (default: the default model's)"
    )
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--system", default="You are a helpful assistant.")
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.tokenizer or default_model_dir())
    chat = AppendOnlyChat(tokenizer)
    pending = [{"role": "system", "content": args.system}]
    interactive = sys.stdin.isatty()
    client = kakeya.Client(args.address, api_key=args.api_key)
    with client, client.create_session(eos_token_ids=[tokenizer.eos_token_id], label="streaming-chat") as session:
        while True:
            if interactive:
                print("> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            delta = chat.add_messages([*pending, {"role": "user", "content": line.rstrip("\n")}])
            pending = []
            session.append(delta)
            reply: list[int] = []
            shown = ""
            for token in session.generate(args.max_tokens, inter_token_timeout_s=60):
                reply.append(token)
                text = tokenizer.decode(reply, skip_special_tokens=True)
                print(text[len(shown) :], end="", flush=True)
                shown = text
            chat.add_generated(reply)
            stats = session.last_generation
            assert stats is not None
            print(
                f"\n[{stats.stop_reason.value}: {stats.generated_token_count} tokens, prefilled "
                f"{stats.prefill_token_count} in {stats.prefill_duration_s * 1000:.1f} ms, "
                f"history {len(chat.tokens)} tokens]"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
