"""The OpenAPI document: request bodies from the pydantic request models, every response the
server gives (200 as JSON or SSE, each error status with the OpenAI error envelope), `/metrics` as
Prometheus text. The response models here only document; handlers build plain dicts.

Handlers read their bodies themselves (to count bytes for 413 and to map every validation error
to the envelope), so FastAPI cannot see the request models: `request_body` names them in each
route's `openapi_extra`, and `build` copies their JSON schemas into the components. Limits of the
served model (context length, vocabulary) are written into the schemas, so what the document
allows is what the server accepts; the one limit a schema cannot state is the sum of prompt
tokens and `max_tokens` against the context, which the descriptions say.
"""

from __future__ import annotations

from typing import Literal

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from jaxserve.protocol import ChatCompletionRequest, CompletionRequest

Finish = Literal["stop", "length", "abort"] | None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """The OpenAI error envelope."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Finish


class Completion(BaseModel):
    """A completion; streamed as `text_completion` chunks of the same shape (`finish_reason` null
    until the last, `usage` null or absent but with `stream_options`), then `data: [DONE]`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Finish


class ChatCompletion(BaseModel):
    """A chat completion; streamed as `chat.completion.chunk` objects whose choices carry a `delta`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Finish


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    chat_template: str = Field(description="model, file:NAME, or builtin:NAME when the model has no template of "
                                           "its own (a base model: prefer /v1/completions)")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


def _sse(chunk: str) -> dict:
    """Server-sent events (Open API 3.1: the schema is one event's): each `data` is a JSON chunk
    (or an error envelope), the last one `[DONE]`."""
    payload = {"anyOf": [{"$ref": f"#/components/schemas/{chunk}"}, {"$ref": "#/components/schemas/ErrorResponse"}]}
    data = {"type": "string", "if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json", "contentSchema": payload}}
    return {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
        "data": data, "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}}}
_ERRORS = {
    400: "malformed JSON, an unknown field, a wrong type or value, or a prompt plus max_tokens past the context",
    401: "a missing or wrong `Authorization: Bearer` key",
    404: "another model's name",
    413: "a body past the size limit",
    429: "the waiting queue is full; retry after `Retry-After` seconds",
    500: "the engine failed while generating this request",
    503: "the engine has stopped",
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait", "required": True, "schema": {"type": "string"}}}


def errors(*statuses: int) -> dict:
    out = {}
    for s in statuses:
        out[s] = {"model": ErrorResponse, "description": _ERRORS[s]}
        if s == 429:
            out[s]["headers"] = _RETRY_AFTER
    return out


def generation_responses(model: type[BaseModel], chunk: type[BaseModel], auth: bool,
                         headers: dict | None = None) -> dict:
    ok = {"model": model, "description": "the completion (JSON), or its chunks (SSE) when `stream` is true",
          "content": _sse(chunk.__name__)}
    if headers:
        ok["headers"] = headers
    return {200: ok, **errors(400, *([401] if auth else []), 404, 413, 429, 500, 503)}


def request_body(model: type[BaseModel]) -> dict:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


METRICS = {200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}


def build(app, max_model_len: int, vocab_size: int | None, auth: bool) -> dict:
    """The document of `app`, with the request models and the served model's limits filled in."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in (CompletionRequest, ChatCompletionRequest, ChatCompletionChunk, ErrorResponse):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        props["max_tokens"]["maximum"] = max_model_len - 1
        props["max_tokens"]["description"] = (f"at most {max_model_len} (the context) minus the prompt's "
                                              "tokens; default: 16 for completions, the rest of the context for chat")
        if "max_completion_tokens" in props:
            props["max_completion_tokens"]["maximum"] = max_model_len - 1
        if vocab_size:
            props["stop_token_ids"]["anyOf"][0]["items"]["maximum"] = vocab_size - 1
    if vocab_size:
        token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
                     "minItems": 1, "maxItems": max_model_len - 1}
        prompt = schemas["CompletionRequest"]["properties"]["prompt"]
        prompt["anyOf"] = [{"type": "string", "minLength": 1},
                           {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                           token_ids, {"type": "array", "items": token_ids, "minItems": 1}]
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in doc["paths"].items():
            if path.startswith("/v1/"):
                for op in ops.values():
                    op["security"] = [{"bearer": []}]
    return doc

