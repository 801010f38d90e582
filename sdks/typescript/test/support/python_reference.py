"""Token streams of the same generations from Python, for the TypeScript SDK's cross-language check.

Reads a JSON list of cases on stdin and prints a JSON list of results on stdout, one per case:

    case:   {"address": "127.0.0.1:50051", "initial_tokens": [...], "appends": [[...], ...],
             "max_tokens": 8, "seed": 7, "temperature": 0.8, "top_p": 0.9, "top_k": 40}
    result: {"tokens": [...], "stop_reason": "max_tokens"}

`generate_reference` is the only code that talks to the server, through the server's generated gRPC stubs; a
different Python client replaces that one function.

Usage:
    echo '[{"address": "127.0.0.1:50051", "initial_tokens": [1, 2, 3], "max_tokens": 4}]' | \
        .venv/bin/python sdks/typescript/test/support/python_reference.py
"""

from __future__ import annotations

import json
import sys
from typing import Any

import grpc

from inference_engine.generated import runtime_pb2 as pb
from inference_engine.generated import runtime_pb2_grpc

_STOP_REASONS = {
    pb.STOP_REASON_MAX_TOKENS: "max_tokens",
    pb.STOP_REASON_EOS: "eos",
    pb.STOP_REASON_CANCELLED: "cancelled",
    pb.STOP_REASON_TRUNCATED: "truncated",
}


def generate_reference(case: dict[str, Any]) -> dict[str, Any]:
    """Create a session, deliver the history, generate once, close; return the tokens and the stop reason."""
    with grpc.insecure_channel(case["address"]) as channel:
        stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
        created = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=case.get("initial_tokens", [])))
        session_id = created.session_id
        for tokens in case.get("appends", []):
            stub.AppendTokens(pb.AppendTokensRequest(session_id=session_id, token_ids=tokens))
        sampling = {key: case[key] for key in ("seed", "temperature", "top_p", "top_k") if key in case}
        request = pb.GenerateRequest(session_id=session_id, max_tokens=case["max_tokens"], **sampling)
        tokens_out: list[int] = []
        stop_reason = None
        for response in stub.Generate(request, timeout=120):
            kind = response.WhichOneof("payload")
            if kind == "token_id":
                tokens_out.append(response.token_id)
            elif kind == "done":
                stop_reason = _STOP_REASONS.get(response.done.stop_reason, "unspecified")
        stub.CloseSession(pb.CloseSessionRequest(session_id=session_id))
    return {"tokens": tokens_out, "stop_reason": stop_reason}


def main() -> int:
    cases = json.load(sys.stdin)
    json.dump([generate_reference(case) for case in cases], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
