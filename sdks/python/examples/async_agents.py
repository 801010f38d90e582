"""Several agents at once on one asyncio client: each agent owns a session and drives it over one `Converse`
stream (append the task, generate, append a tool result, generate again), all agents concurrently.

Run a daemon first (`scripts/serve.sh`; add `--max-concurrent 2` to let two generations run at once), then:

    python sdks/python/examples/async_agents.py [--address 127.0.0.1:50051] [--agents 3] [--steps 3]

Needs the tokenization extra: pip install 'kakeya[tokenization]'.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import kakeya
from kakeya.tokenization import AppendOnlyChat, load_tokenizer

BUNDLED_MODEL = Path(__file__).resolve().parents[3] / "inference_engine" / "models" / "kakeya-tiny"


def run_tool(reply: str) -> str:
    """A stand-in tool: it reports what it was given."""
    return f"tool saw {len(reply)} characters, {sum(ch.isalpha() for ch in reply)} letters"


async def agent(name: str, client: kakeya.AsyncClient, tokenizer: Any, steps: int, max_tokens: int) -> str:
    chat = AppendOnlyChat(tokenizer)
    messages: list[dict[str, str]] = [
        {"role": "system", "content": f"You are agent {name}. Use the tool, then answer."},
        {"role": "user", "content": f"Task for {name}: summarise the tool output."},
    ]
    async with await client.create_session(eos_token_ids=[tokenizer.eos_token_id], label=name) as session:
        async with session.converse(inter_token_timeout_s=120) as conversation:
            for step in range(steps):
                await conversation.append(chat.add_messages(messages))
                stream = await conversation.generate(max_tokens)
                reply = [token async for token in stream]
                chat.add_generated(reply)
                text = tokenizer.decode(reply, skip_special_tokens=True)
                assert stream.stats is not None
                print(f"[{name} step {step}] {stream.stats.stop_reason.value}, {len(reply)} tokens: {text[:40]!r}")
                messages = [{"role": "user", "content": run_tool(text)}]
        info = await session.info()
        assert info.history_length == len(chat.tokens), "the session holds exactly the chat's tokens"
        return f"{name}: history {info.history_length} tokens, KV {info.kv_live_bytes} bytes"


async def run(args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer(args.tokenizer)
    async with kakeya.AsyncClient(args.address, api_key=args.api_key) as client:
        names = [f"agent-{i}" for i in range(args.agents)]
        summaries = await asyncio.gather(*(agent(n, client, tokenizer, args.steps, args.max_tokens) for n in names))
    print("\n".join(summaries))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--tokenizer", type=Path, default=BUNDLED_MODEL, help="local tokenizer directory")
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    asyncio.run(run(parser.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
