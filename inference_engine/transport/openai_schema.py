"""Request bodies the HTTP shim accepts, validated strictly, and the OpenAI-shaped error every refusal becomes.

Parameters that would change the output but are not implemented (several choices, log probabilities, tools,
structured output, penalties, ...) are accepted only at their neutral value and otherwise refused with a 400:
a legacy client never silently gets something other than what it asked for.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ApiError(Exception):
    """A refusal in the OpenAI error envelope: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # strict: no "5" for 5, no 1 for true; forbid: an argument the shim does not know is refused, not dropped
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by both completion endpoints."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=1 << 64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # accepted at their neutral value only (checked by `refuse_unsupported`)
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


RequestT = TypeVar("RequestT", "ChatCompletionRequest", "CompletionRequest")

_FIELD_NAMES = frozenset(
    name
    for model in (ChatCompletionRequest, CompletionRequest, ChatMessage, TextPart, StreamOptions)
    for name in model.model_fields
)


def parse_request(model: type[RequestT], raw: bytes) -> RequestT:
    """Parse and validate a JSON body, refusing anything invalid or unsupported with a 400 `ApiError`."""
    try:
        request = model.model_validate_json(raw)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    refuse_unsupported(request)
    return request


def refuse_unsupported(request: _Sampling) -> None:
    """Refuse parameters whose value asks for a behaviour the shim does not implement."""
    if request.n not in (None, 1):
        _unsupported("n", f"n={request.n}: the shim returns one choice per request (send several requests)")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name) not in (None, 0):
            _unsupported(name, f"{name} is not supported (only 0)")
    if request.logit_bias:
        _unsupported("logit_bias", "logit_bias is not supported")
    if request.stream_options is not None and not request.stream:
        raise ApiError(
            400, "stream_options is only allowed when stream is true", param="stream_options", code="invalid_value"
        )
    stops = request.stop_strings
    if len(stops) > 4:
        raise ApiError(
            400, f"stop holds {len(stops)} strings, at most 4 are allowed", param="stop", code="invalid_value"
        )
    if any(s == "" for s in stops):
        raise ApiError(400, "stop strings must not be empty", param="stop", code="invalid_value")
    if isinstance(request, ChatCompletionRequest):
        _refuse_unsupported_chat(request)
    elif isinstance(request, CompletionRequest):
        _refuse_unsupported_completion(request)


def _refuse_unsupported_chat(request: ChatCompletionRequest) -> None:
    if request.max_tokens is not None and request.max_completion_tokens not in (None, request.max_tokens):
        raise ApiError(
            400,
            "max_tokens and max_completion_tokens disagree; send only max_completion_tokens",
            param="max_tokens",
            code="invalid_value",
        )
    if request.logprobs or request.top_logprobs is not None:
        _unsupported("logprobs" if request.logprobs else "top_logprobs", "log probabilities are not supported")
    if request.response_format is not None and request.response_format != {"type": "text"}:
        _unsupported("response_format", "response_format other than {'type': 'text'} is not supported")
    for name in ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"):
        if getattr(request, name) is not None:
            _unsupported(name, f"{name}: tool and function calling are not supported")


def _refuse_unsupported_completion(request: CompletionRequest) -> None:
    if request.logprobs is not None:
        _unsupported("logprobs", "log probabilities are not supported")
    if request.echo:
        _unsupported("echo", "echo is not supported")
    if request.best_of not in (None, 1):
        _unsupported("best_of", f"best_of={request.best_of}: the shim returns one choice per request")
    if request.suffix is not None:
        _unsupported("suffix", "suffix (insertion) is not supported")
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) != 1:
        _unsupported("prompt", f"a batch of {len(prompt)} prompts: the shim serves one prompt per request")


def _unsupported(param: str, message: str) -> None:
    raise ApiError(
        400,
        f"{message}. This deprecated shim is feature-frozen; see the migration guide.",
        param=param,
        code="unsupported_parameter",
    )


def _validation_error(exc: ValidationError) -> ApiError:
    # For a union the deepest location names what actually failed (the list branch, not "expected a string").
    first = max(exc.errors(), key=lambda error: len(error["loc"]))
    param = _param_path(first["loc"], unknown_last=first["type"] == "extra_forbidden")
    if first["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first['msg']}", code="invalid_json")
    if first["type"] == "model_type" and not first["loc"]:
        return ApiError(400, "the body must be a JSON object", code="invalid_json")
    if first["type"] == "extra_forbidden":
        return ApiError(
            400,
            f"unrecognized request argument {param!r}: this deprecated shim does not support it",
            param=param,
            code="unsupported_parameter",
        )
    if first["type"] == "missing":
        return ApiError(400, f"missing required parameter {param!r}", param=param, code="missing_required_parameter")
    return ApiError(400, f"{param}: {first['msg']}", param=param or None, code="invalid_value")


def _param_path(loc: tuple[int | str, ...], *, unknown_last: bool) -> str:
    """`messages[1].content` from a pydantic location; union branch tags such as `list[str]` are left out, and
    with `unknown_last` the last part is an unknown field's name and is kept."""
    path = ""
    for index, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _FIELD_NAMES or (unknown_last and index == len(loc) - 1):
            path += f".{part}" if path else part
    return path
