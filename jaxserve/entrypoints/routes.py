"""The HTTP routes of the API server, on two routers that create_app (api_server.py) includes;
each handler finds the engine and the server's settings in `request.app.state` (app_state.py).

    router             GET /health, /metrics, /v1/models, /v1/engine/state
    generation_router  POST /v1/completions, /v1/chat/completions: read the body (413 past
                       max_body_bytes) ─► pydantic model (400; request_body.py) ─► serving_completion.py,
                       serving_chat.py: the prompts as token ids, submitted, then JSON or SSE

The /v1/ routes ask for the API key when the server has one (`authorize`). Route functions have no
docstrings: FastAPI would write them into the OpenAPI document.
"""

from __future__ import annotations

import hmac
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from jaxserve.engine.state import engine_state
from jaxserve.entrypoints import openapi
from jaxserve.entrypoints.chat_template import HEADER
from jaxserve.entrypoints.engine_client import EngineDeadError
from jaxserve.entrypoints.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from jaxserve.entrypoints.request_body import parsed_body
from jaxserve.entrypoints.serving_chat import create_chat_completion
from jaxserve.entrypoints.serving_completion import create_completion


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
    return await create_completion(request, await parsed_body(request, CompletionRequest), arrival)


@generation_router.post(
    "/v1/chat/completions", openapi_extra=openapi.request_body(ChatCompletionRequest),
    responses=openapi.generation_responses(openapi.ChatCompletion, openapi.ChatCompletionChunk, {HEADER: {
        "description": "the chat template used: model, file:NAME, request, or builtin:NAME when the "
                       "model has none of its own", "required": True, "schema": {"type": "string"}}}))
async def chat_completions(request: Request):
    arrival = time.monotonic()
    return await create_chat_completion(request, await parsed_body(request, ChatCompletionRequest), arrival)
