"""An agent step that calls a tool through a JSON schema: the model's reply is constrained to a tool call that the
schema describes, so it always parses; the tool runs locally, its result is appended to the same session, and the
model answers in a line of free text that a stop sequence (the newline token) ends, with per-token confidence.

Run a daemon first (`scripts/serve.sh` serves the bundled kakeya-tiny model, whose arguments are arbitrary but
always valid for the schema), then:

    python sdks/python/examples/tool_call.py [--address 127.0.0.1:50051] [--tokenizer DIR]

Needs the tokenization extra: pip install 'kakeya[tokenization]'.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import kakeya
from kakeya.tokenization import load_tokenizer

BUNDLED_MODEL = Path(__file__).resolve().parents[3] / "inference_engine" / "models" / "kakeya-tiny"

TOOL_CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "tool": {"enum": ["add", "weather"]},
        "arguments": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "city": {"type": "string", "maxLength": 12},
            },
            "required": ["a", "b", "city"],
            "additionalProperties": False,
        },
    },
    "required": ["tool", "arguments"],
    "additionalProperties": False,
}


def run_tool(call: dict[str, Any]) -> str:
    """The local tools the model may call."""
    arguments = call["arguments"]
    if call["tool"] == "add":
        return str(arguments["a"] + arguments["b"])
    return f"sunny in {arguments['city'] or 'an unnamed city'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--tokenizer", type=Path, default=BUNDLED_MODEL, help="local tokenizer directory")
    parser.add_argument("--question", default="What is 12 plus 30?")
    parser.add_argument("--answer-tokens", type=int, default=24)
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.tokenizer)
    eos = tokenizer.eos_token_id
    newline = tokenizer.encode("\n", add_special_tokens=False)
    prompt = f"Tools: add(a, b), weather(city). Reply with a JSON tool call.\nUser: {args.question}\nCall: "
    client = kakeya.Client(args.address, api_key=args.api_key)
    with client, client.create_session(eos_token_ids=[eos], label="tool-call") as session:
        session.append(tokenizer.encode(prompt, add_special_tokens=False))

        call_controls = kakeya.GenerationControls(grammar=kakeya.Grammar.json_schema(TOOL_CALL_SCHEMA))
        reply = list(session.generate(160, controls=call_controls, inter_token_timeout_s=60))
        stats = session.last_generation
        assert stats is not None
        if stats.stop_reason is not kakeya.StopReason.EOS:
            print(f"no complete tool call: {stats.stop_reason.value} after {len(reply)} tokens")
            return 1
        call = json.loads(tokenizer.decode(reply[:-1]))  # the grammar guarantees a valid call before the EOS
        print(f"tool call: {json.dumps(call)}")
        result = run_tool(call)
        print(f"tool result: {result}")

        session.append(tokenizer.encode(f"\nResult: {result}\nAnswer:", add_special_tokens=False))
        answer_controls = kakeya.GenerationControls(
            stop_sequences=(tuple(newline),), logprobs=True, top_logprobs=3, repetition_penalty=1.2
        )
        stream = session.generate(args.answer_tokens, controls=answer_controls, inter_token_timeout_s=60)
        answer = list(stream)
        stats = session.last_generation
        assert stats is not None
        confidence = math.exp(sum(s.logprob for s in stream.logprobs) / max(1, len(stream.logprobs)))
        print(f"answer: {tokenizer.decode(answer, skip_special_tokens=True).strip()!r}")
        print(
            f"[{stats.stop_reason.value}: {len(answer)} tokens, mean token probability {confidence:.3f}, "
            f"first token alternatives {[t for t, _ in stream.logprobs[0].top_logprobs]}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
