"""The OpenAPI document: request bodies from the pydantic request models, every response the
server gives (200 as JSON or SSE, each error status with the OpenAI error envelope), `/metrics` as
Prometheus text. The response models here only document; handlers build plain dicts.

Handlers read their bodies themselves (to count bytes for 413 and to map every validation error
to the envelope), so FastAPI cannot see the request models: `request_body` names them in each
route's `openapi_extra`, and `build` copies their JSON schemas into the components. Limits of the
served model (context length, vocabulary) are written into the schemas, so what the document
allows is what the server accepts; the one limit a schema cannot state is the sum of prompt
tokens and `max_tokens` against the context, which the descriptions say. Routes are declared once
for every app: the /v1/ routes list a 401, which `build` keeps, with the bearer scheme, only when
the server has an API key.
"""

from __future__ import annotations

from typing import Literal

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from jaxserve.entrypoints.protocol import ChatCompletionRequest, CompletionRequest

Finish = Literal["stop", "length", "abort", "tool_calls"] | None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """The OpenAI error envelope."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose K/V came from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


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


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments, as JSON text")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class StreamedToolCall(ToolCall):
    index: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="the reply's text; null when it is only tool_calls")
    tool_calls: list[ToolCall] | None = Field(None, description="the calls the reply makes: with tool_choice "
                                                                 "naming a function or \"required\", or read by "
                                                                 "the server's tool-call parser (\"auto\")")


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
    tool_calls: list[StreamedToolCall] | None = Field(None, description="a reply constrained to tool calls: "
                                                                         "all its calls, in the last delta; with "
                                                                         "\"auto\": each call whole, once it is "
                                                                         "complete")


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


# ---- GET /v1/engine/state (built by jaxserve/engine/state.py) ----

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SlotState(_Strict):
    """One batch slot: the request holding it (by id; never its text) and its token counts."""

    slot: int
    request_id: str | None
    phase: Literal["prefill", "decode", "free"] = Field(description="prefill while more than one token is left "
                                                                    "to compute, then decode")
    num_tokens: int = Field(description="prompt plus output tokens so far")
    num_computed_tokens: int = Field(description="tokens whose K/V are in the pool")
    num_prompt_tokens: int
    num_output_tokens: int
    max_tokens: int
    num_cached_tokens: int = Field(description="prompt tokens found in the prefix cache")
    pages: int = Field(description="KV pages the request holds")
    age_s: float = Field(description="seconds since the request arrived")


class WaitingRequest(_Strict):
    request_id: str
    num_tokens: int
    wait_s: float


class GroupPages(_Strict):
    window: int | None = Field(description="the group's sliding window; null for full attention")
    used: int = Field(description="pages the group's sequences read")
    cached: int = Field(description="pages of the group kept for the prefix cache")


class PagePool(_Strict):
    total: int = Field(description="pages in the pool, the null page excluded")
    free: int
    cached: int = Field(description="read by no sequence, kept for the prefix cache")
    used: int = Field(description="read by running sequences")
    shared: int = Field(description="used pages read by more than one sequence")
    page_size: int
    cell: int = Field(description="pages per cell of `owners`: 1 up to 4096 pages, more past that")
    owners: list[tuple[int, int]] = Field(
        description="run-length encoded owner of pages 1..total, cell by cell: [owner, count] pairs, where owner "
                    "is the slot reading the page, -1 free, -2 cached or -3 shared (a cell of several pages shows "
                    "its busiest: a slot before shared, cached and free)")
    groups: list[GroupPages] = Field(
        description="KV-cache groups: layers of one attention kind share block tables; a sliding-window group "
                    "frees the pages its window has passed. Free pages belong to no group")


class StepSample(_Strict):
    step: int
    time: float = Field(description="Unix time at dispatch")
    tokens: int
    decode_rows: int
    prefill_tokens: int
    running: int
    waiting: int
    used_pages: int
    cached_pages: int


class GroupStats(_Strict):
    window: int | None = Field(description="the group's sliding window; null for full attention")
    used_pages: int
    cached_pages: int


class EngineStats(_Strict):
    """Engine.stats(): counts since the engine started, and the pool now."""

    running: int
    waiting: int
    free_pages: int = Field(description="unreferenced, holding nothing reusable")
    cached_pages: int = Field(description="unreferenced, holding a prefix-cache page")
    used_pages: int = Field(description="read by running requests")
    total_pages: int
    kv_groups: list[GroupStats] = Field(description="per KV-cache group, its window and used and cached pages")
    prefix_cache_queries: int = Field(description="prompt tokens looked up")
    prefix_cache_hits: int = Field(description="of those, found in the cache")
    num_compiles: int
    tokens_run: int = Field(description="real tokens through the model")
    tokens_computed: int = Field(description="the same with bucket padding")
    num_preemptions: int
    num_errors: int
    num_steps: int
    structured_output_mask_seconds: float = Field(description="host time filling token masks")
    structured_output_mask_steps: int = Field(description="steps that filled one")
    spec_decode_num_drafts: int = Field(description="speculative drafts verified: one per request and step")
    spec_decode_num_draft_tokens: int = Field(description="their tokens")
    spec_decode_num_accepted_tokens: int = Field(description="of those, the tokens accepted")


class EngineState(_Strict):
    """What the engine is doing now, taken between two steps (no device sync)."""

    model: str
    strategy: Literal["none", "static", "dynamic", "continuous", "paged"]
    step: int = Field(description="steps run so far")
    time: float = Field(description="Unix time of the snapshot")
    max_slots: int
    max_model_len: int
    token_budget: int = Field(description="tokens one step may run")
    num_running: int
    num_waiting: int
    slots: list[SlotState]
    waiting: list[WaitingRequest] = Field(description="the first 256 waiting requests, in queue order")
    pages: PagePool
    history: list[StepSample] = Field(description="the steps after `since` (at most 1024), else the last 64")
    stats: EngineStats


ENGINE_STATE_QUERY = {"parameters": [{
    "name": "since", "in": "query", "required": False,
    "description": "a step number: the history then holds only the steps after it",
    "schema": {"type": "integer", "minimum": 0}}]}


def engine_state_responses() -> dict:
    return {200: {"model": EngineState, "description": "the snapshot"},
            400: {"model": ErrorResponse, "description": "`since` is not a step number"},
            **errors(401, 503)}


def static_file(media_type: str, what: str) -> dict:
    return {200: {"description": what, "content": {media_type: {"schema": {"type": "string"}}}}}


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


def generation_responses(model: type[BaseModel], chunk: type[BaseModel], headers: dict | None = None) -> dict:
    ok = {"model": model, "description": "the completion (JSON), or its chunks (SSE) when `stream` is true",
          "content": _sse(chunk.__name__)}
    if headers:
        ok["headers"] = headers
    return {200: ok, **errors(400, 401, 404, 413, 429, 500, 503)}


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
        if path.startswith("/v1/"):  # the routes that ask for the key, and document its 401
            for op in ops.values():
                if auth:
                    op["security"] = [{"bearer": []}]
                else:
                    op["responses"].pop("401", None)
    return doc

