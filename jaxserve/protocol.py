"""OpenAI-compatible request bodies (pydantic, strict types, unknown fields refused) and the error
envelope. Responses are plain dicts built by the server in the OpenAI shapes.

Sampling ranges are checked once, by `SamplingParams`; here only types, `n` and the penalties
that jaxserve does not implement (a non-default value is refused rather than ignored).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_N = 16  # choices per prompt
MAX_CHOICES = 256  # prompts x n in one payload

Prompt = str | list[str] | list[int] | list[list[int]]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _Sampling(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    user: str | None = None  # accepted and ignored, as OpenAI clients may send it
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_additive_penalty(cls, v, info):
        if v not in (None, 0):
            raise ValueError(f"{info.field_name} is not implemented by jaxserve; leave it at 0")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _no_repetition_penalty(cls, v):
        if v not in (None, 1):
            raise ValueError("repetition_penalty is not implemented by jaxserve; leave it at 1")
        return v

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: int | None = None
    echo: bool | None = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


_SHAPES = {"prompt": "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
           "stop": "stop must be a string or a list of strings",
           "content": "message content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts"}


def describe(error: ValidationError) -> tuple[str, str | None]:
    """One readable message and the offending parameter (dotted path) for a pydantic error."""
    e = error.errors(include_url=False)[0]
    loc: list[str] = []
    union = False  # pydantic tags each member of a union in the path: stop there
    for part in e["loc"]:
        if isinstance(part, str) and (part in _UNION_TAGS or "[" in part):
            union = True
            break
        loc.append(str(part))
    param = ".".join(loc) or None
    kind = e["type"]
    if kind == "json_invalid":
        return f"malformed JSON body: {e['msg'].removeprefix('Invalid JSON: ')}", None
    if kind == "model_type" and not loc:
        return "the request body must be a JSON object", None
    if kind == "extra_forbidden":
        return f"unknown field {param!r}", param
    if kind == "missing":
        return f"field {param!r} is required", param
    if union:
        return _SHAPES.get(loc[-1] if loc else "", f"{param} has the wrong type"), param
    if kind == "value_error":
        return str(e.get("ctx", {}).get("error", e["msg"])), param
    return f"{param}: {e['msg']}" if param else e["msg"], param


_UNION_TAGS = {"str", "int", "float", "bool", "TextPart"}


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
