"""Token streams of the same generations from Python, for the TypeScript SDK's cross-language check.

Reads a JSON list of cases on stdin and prints a JSON list of results on stdout, one per case:

    case:   {"address": "127.0.0.1:50051", "initial_tokens": [...], "appends": [[...], ...],
             "max_tokens": 8, "seed": 7, "temperature": 0.8, "top_p": 0.9, "top_k": 40}
    result: {"tokens": [...], "stop_reason": "max_tokens"}

The generations run through the Python SDK `kakeya`, so the check compares the two SDKs end to end.

Usage:
    echo '[{"address": "127.0.0.1:50051", "initial_tokens": [1, 2, 3], "max_tokens": 4}]' | \
        .venv/bin/python sdks/typescript/test/support/python_reference.py
"""

from __future__ import annotations

import json
import sys
from typing import Any

import kakeya


def generate_reference(case: dict[str, Any]) -> dict[str, Any]:
    """Create a session, deliver the history, generate once, close; return the tokens and the stop reason."""
    with (
        kakeya.Client(case["address"], timeout_s=120) as client,
        client.create_session(initial_tokens=case.get("initial_tokens", [])) as session,
    ):
        for tokens in case.get("appends", []):
            session.append(tokens)
        sampling = {key: case[key] for key in ("seed", "temperature", "top_p", "top_k") if key in case}
        tokens_out = list(session.generate(case["max_tokens"], **sampling))
        stats = session.last_generation
    return {"tokens": tokens_out, "stop_reason": stats.stop_reason.value if stats else None}


def main() -> int:
    cases = json.load(sys.stdin)
    json.dump([generate_reference(case) for case in cases], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
