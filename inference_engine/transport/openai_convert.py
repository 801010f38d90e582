"""Every OpenAI <-> domain conversion of the HTTP shim: requests to generation parameters, results to response
bodies and stream chunks, service errors to the OpenAI error envelope."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from inference_engine.domain import GenerateParams, StopReason
from inference_engine.errors import ServiceError, Status
from inference_engine.transport.openai_schema import ApiError, ChatCompletionRequest, CompletionRequest
from inference_engine.transport.single_shot import SingleShotGeneration
from inference_engine.transport.text_codec import TokenizerUnavailable

# OpenAI's defaults where the request leaves a field out
DEFAULT_TEMPERATURE = 1.0
DEFAULT_COMPLETION_MAX_TOKENS = 16  # the legacy completions endpoint's default; chat defaults to the server limit

_STATUS = {
    Status.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    Status.NOT_FOUND: (503, "server_error", "session_lost"),  # the request's own session was evicted under load
    Status.FAILED_PRECONDITION: (500, "server_error", "session_failed"),
    Status.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "resource_exhausted"),
    Status.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    Status.UNAVAILABLE: (503, "server_error", "unavailable"),
}


@dataclass(frozen=True, slots=True)
class Reply:
    """Identity shared by a response and all of its stream chunks."""

    model: str
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))


# -- requests ----------------------------------------------------------------------------------------------------
def generate_params(request: ChatCompletionRequest | CompletionRequest, *, max_generate_tokens: int) -> GenerateParams:
    """Sampling parameters of a request; `max_generate_tokens` is the server's limit and the chat default."""
    if isinstance(request, ChatCompletionRequest):
        limit, name = request.token_limit, "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        max_tokens = max_generate_tokens if limit is None else limit
    else:
        limit, name = request.max_tokens, "max_tokens"
        max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, max_generate_tokens) if limit is None else limit
    if max_tokens > max_generate_tokens:
        raise ApiError(
            400,
            f"{name}={max_tokens} is above this server's limit of {max_generate_tokens} (--max-generate-tokens)",
            param=name,
            code="invalid_value",
        )
    return GenerateParams(
        max_tokens=max_tokens,
        seed=request.seed,
        temperature=DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        top_p=request.top_p,
    )


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as the chat template expects them; text parts of one message are joined by newlines."""
    out = []
    for message in request.messages:
        content = message.content
        text = content if isinstance(content, str) else "\n".join(part.text for part in content)
        out.append({"role": message.role, "content": text})
    return out


def completion_prompt(request: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: text, or token ids (batches were refused by the schema)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return prompt
    first = prompt[0] if prompt else None
    if isinstance(first, str | list):
        return first
    return [token for token in prompt if isinstance(token, int)]


def label(request: ChatCompletionRequest | CompletionRequest) -> str:
    return f"http-shim user={request.user}" if request.user else "http-shim"


# -- results -----------------------------------------------------------------------------------------------------
def finish_reason(job: SingleShotGeneration) -> str:
    """`stop` for EOS or a stop string, `length` for max_tokens or the history limit."""
    if job.stop_string_hit or job.stop_reason is StopReason.EOS:
        return "stop"
    if job.stop_reason in (StopReason.MAX_TOKENS, StopReason.TRUNCATED):
        return "length"
    raise cancelled_error(client_disconnected=job.client_disconnected)


def usage(job: SingleShotGeneration) -> dict[str, int]:
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.completion_tokens,
        "total_tokens": job.prompt_tokens + job.completion_tokens,
    }


def chat_completion(reply: Reply, text: str, job: SingleShotGeneration) -> dict[str, Any]:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text, "refusal": None},
        "logprobs": None,
        "finish_reason": finish_reason(job),
    }
    return {**_head(reply, "chat.completion"), "choices": [choice], "usage": usage(job)}


def chat_chunk(
    reply: Reply, delta: dict[str, str], *, finish: str | None = None, with_usage: bool = False
) -> dict[str, Any]:
    chunk = {
        **_head(reply, "chat.completion.chunk"),
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if with_usage:
        chunk["usage"] = None  # filled only in the final usage chunk
    return chunk


def completion(reply: Reply, text: str, job: SingleShotGeneration) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(job)}
    return {**_head(reply, "text_completion"), "choices": [choice], "usage": usage(job)}


def completion_chunk(reply: Reply, text: str, *, finish: str | None = None, with_usage: bool = False) -> dict[str, Any]:
    chunk = {
        **_head(reply, "text_completion"),
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    if with_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(reply: Reply, kind: str, job: SingleShotGeneration) -> dict[str, Any]:
    """The last chunk of a stream that asked for `stream_options.include_usage`: no choices, the usage."""
    return {**_head(reply, kind), "choices": [], "usage": usage(job)}


def model_card(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "kakeya"}


def _head(reply: Reply, kind: str) -> dict[str, Any]:
    prefix = "chatcmpl-" if kind.startswith("chat") else "cmpl-"
    return {
        "id": prefix + reply.id,
        "object": kind,
        "created": reply.created,
        "model": reply.model,
        "system_fingerprint": None,
    }


# -- errors ------------------------------------------------------------------------------------------------------
def api_error(exc: ServiceError) -> ApiError:
    """The HTTP status and envelope of a service error."""
    status, kind, code = _STATUS[exc.status]
    if isinstance(exc, TokenizerUnavailable):
        code = "tokenizer_unavailable"
    return ApiError(status, exc.message, type=kind, code=code)


def cancelled_error(*, client_disconnected: bool) -> ApiError:
    """The error of a cancelled generation: the client went away (499, nobody reads it) or the server shuts down."""
    if client_disconnected:
        return ApiError(
            499,
            "the client disconnected, so its generation was cancelled",
            type="invalid_request_error",
            code="client_disconnected",
        )
    return ApiError(
        503, "the generation was cancelled by the server (shutting down)", type="server_error", code="cancelled"
    )


def model_not_found(requested: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"the model {requested!r} does not exist on this server, which serves {served!r}",
        param="model",
        code="model_not_found",
    )
