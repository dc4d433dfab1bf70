"""The HTTP routes of the API server, on two routers that create_app (api_server.py) includes;
each handler finds the engine and the server's settings in `request.app.state` (app_state.py).

    router             GET /health, /metrics, /v1/models, /v1/engine/state
    generation_router  POST /v1/completions, /v1/chat/completions: read the body (413 past
                       max_body_bytes) ─► pydantic model (400) ─► the prompt as token ids
                       ─► completion_job.Job: submit, then JSON or SSE

The /v1/ routes ask for the API key when the server has one (`authorize`). Route functions have no
docstrings: FastAPI would write them into the OpenAPI document.
"""

from __future__ import annotations

import hmac
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from jaxserve.engine.batching import SamplingParams
from jaxserve.engine.state import engine_state
from jaxserve.entrypoints import openapi
from jaxserve.entrypoints.chat_template import HEADER
from jaxserve.entrypoints.completion_job import Job, Payload, param_of
from jaxserve.entrypoints.constraints import constraint
from jaxserve.entrypoints.engine_client import EngineDeadError
from jaxserve.entrypoints.protocol import ApiError, ChatCompletionRequest, CompletionRequest, describe


async def authorize(request: Request) -> None:
    """401 unless the request bears the server's API key (when it has one)."""
    api_key = request.app.state.options.api_key
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                       "authentication_error", code="invalid_api_key")


router = APIRouter()
generation_router = APIRouter(dependencies=[Depends(authorize)])


@router.get("/health", response_model=openapi.Health, responses=openapi.errors(503))
async def health(request: Request):
    client = request.app.state.engine
    if not client.alive:
        raise ApiError(503, client.not_running_message, "server_error")
    return {"status": "ok"}


@router.get("/metrics", response_class=PlainTextResponse, responses=openapi.METRICS)
async def prometheus(request: Request):
    metrics = request.app.state.metrics
    return PlainTextResponse(metrics.render(), media_type=metrics.content_type)


@router.get("/v1/models", dependencies=[Depends(authorize)], response_model=openapi.ModelList,
            responses=openapi.errors(401))
async def models(request: Request):
    model = request.app.state.model
    return {"object": "list", "data": [{"id": model.name, "object": "model", "created": model.created,
                                        "owned_by": "jaxserve", "max_model_len": model.max_model_len,
                                        "chat_template": model.templates.source}]}


@router.get("/v1/engine/state", dependencies=[Depends(authorize)], openapi_extra=openapi.ENGINE_STATE_QUERY,
            responses=openapi.engine_state_responses())
async def engine_state_route(request: Request):
    since = request.query_params.get("since")
    if since is not None and not (since.isascii() and since.isdigit()):
        raise ApiError(400, "since must be a step number (an integer >= 0)", param="since")
    try:
        state = await request.app.state.engine.call(engine_state, None if since is None else int(since))
    except EngineDeadError as e:
        raise ApiError(503, str(e), "server_error")
    return JSONResponse(state)


@generation_router.post("/v1/completions", openapi_extra=openapi.request_body(CompletionRequest),
                        responses=openapi.generation_responses(openapi.Completion, openapi.Completion))
async def completions(request: Request):
    arrival = time.monotonic()
    state = request.app.state
    model, default_max_tokens = state.model, state.options.default_max_tokens
    body = await _parse(request, CompletionRequest)
    model.check_model(body)
    texts = _completion_prompts(body.prompt)
    if body.echo and body.logprobs is not None:
        raise ApiError(400, "echo with logprobs is not supported (prompt logprobs are not computed)",
                       param="echo")
    add_special = body.add_special_tokens is not False
    prompts = [model.truncate(model.encode(p, add_special) if isinstance(p, str) else p, body.truncate_prompt_tokens)
               for p in texts]
    tokenizer = model.tokenizer
    echo = [(p if isinstance(p, str) else tokenizer.decode(p) if tokenizer else "") if body.echo else ""
            for p in texts]
    max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = min(default_max_tokens, model.room(max(map(len, prompts)))) if default_max_tokens else 16
    params = _sampling(body, max_tokens, body.logprobs, model.info.vocab_size, constraint(body, chat=False)[0])
    payload = Payload(prompts, params, body.n, echo, chat=False, logprobs=body.logprobs is not None,
                      include_stop=bool(body.include_stop_str_in_output), request_id=body.request_id,
                      cache_salt=body.cache_salt)
    job = Job(state.engine, request, model.name, payload, tokenizer, arrival)
    return await job.respond(bool(body.stream), body.include_usage, body.continuous_usage)


@generation_router.post(
    "/v1/chat/completions", openapi_extra=openapi.request_body(ChatCompletionRequest),
    responses=openapi.generation_responses(openapi.ChatCompletion, openapi.ChatCompletionChunk, {HEADER: {
        "description": "the chat template used: model, file:NAME, request, or builtin:NAME when the "
                       "model has none of its own", "required": True, "schema": {"type": "string"}}}))
async def chat_completions(request: Request):
    arrival = time.monotonic()
    state = request.app.state
    model, default_max_tokens = state.model, state.options.default_max_tokens
    body = await _parse(request, ChatCompletionRequest)
    model.check_model(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    structured, tool_calls = constraint(body, chat=True)
    messages = [{"role": m.role, "content": m.text, **({"name": m.name} if m.name else {})}
                for m in body.messages]
    variables = body.chat_template_kwargs
    if body.tools and tool_calls is not None:  # templates that know tools describe them to the model
        variables = {"tools": [t.model_dump(by_alias=True, exclude_none=True) for t in body.tools],
                     **(variables or {})}
    try:
        text, source = model.templates.render(messages, body.add_generation_prompt is not False, body.chat_template,
                                              variables)
    except ValueError as e:
        raise ApiError(400, str(e), param="messages")
    prompt = model.truncate(model.encode(text, bool(body.add_special_tokens)), body.truncate_prompt_tokens)
    if not prompt:
        raise ApiError(400, "the rendered chat is empty", param="messages")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = min(default_max_tokens or model.max_model_len, model.room(len(prompt)))
    params = _sampling(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None, model.info.vocab_size,
                       structured)
    payload = Payload([prompt], params, body.n, [""], chat=True, logprobs=bool(body.logprobs),
                      include_stop=bool(body.include_stop_str_in_output), request_id=body.request_id,
                      cache_salt=body.cache_salt, tool_calls=tool_calls)
    job = Job(state.engine, request, model.name, payload, model.tokenizer, arrival)
    return await job.respond(bool(body.stream), body.include_usage, body.continuous_usage, {HEADER: source})


# ---- request parsing ----

async def _parse(request: Request, model):
    """The body as `model`: 413 past the server's max_body_bytes, 400 for what does not validate."""
    max_bytes = request.app.state.options.max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise ApiError(413, f"the request body ({length} bytes) exceeds the limit of {max_bytes} bytes",
                       code="body_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise ApiError(413, f"the request body exceeds the limit of {max_bytes} bytes",
                               code="body_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected while sending the body")
    try:
        return model.model_validate_json(b"".join(chunks))
    except ValidationError as e:
        message, param = describe(e, model)
        raise ApiError(400, message, param=param)


def _completion_prompts(prompt) -> list:
    """A list of prompts, each a string or a list of token ids."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ApiError(400, "prompt must not be empty", param="prompt")
    return prompts


def _sampling(body, max_tokens: int, logprobs: int | None, vocab_size: int | None,
              structured_outputs=None) -> SamplingParams:
    given = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p") if getattr(body, k) is not None}
    if given.get("top_k") == -1 or given.get("top_k", 0) >= (vocab_size or 2**31):
        given["top_k"] = 0  # -1 is vLLM's "off"; k past the vocabulary keeps every token (and fits int32)
    try:
        return SamplingParams(max_tokens=max_tokens, seed=body.seed, stop=body.stop_list,
                              stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=bool(body.ignore_eos),
                              logprobs=logprobs, structured_outputs=structured_outputs, **given)
    except ValueError as e:
        raise ApiError(400, str(e), param=param_of(str(e)))
