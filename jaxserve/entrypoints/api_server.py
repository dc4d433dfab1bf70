"""The OpenAI-compatible HTTP server (FastAPI), in the API process; the engine runs in its own.

    POST /v1/completions, /v1/chat/completions
      read the body (413 past max_body_bytes) ─► pydantic model (400) ─► SamplingParams (400), with the
      output's constraint (response_format, structured_outputs, tools: structured_requests.py)
      ─► tokenize here (chat: render the chat template first) ─► completion_job.Job
      ─► EngineClient.submit: the engine process adds every prompt x n as one group (400/429)
      ◄─ one list of new token ids per engine step ─► detokenize here ─► JSON, or SSE chunks
    GET /v1/models, /health (503 while the engine starts, with its progress, and once it has
        died), /metrics (Prometheus text),
        /openapi.json (request bodies, responses and errors as they are), /docs
    GET /v1/engine/state ─► EngineClient.call(engine_state): slots, queue, pages, recent steps (JSON)
    GET /dashboard (jaxserve/entrypoints/dashboard.py): a page that polls /v1/engine/state and draws it

A client that disconnects aborts its requests, so their KV pages are freed at once. Every error
is an OpenAI envelope `{"error": {"message", "type", "param", "code"}}`, and no request can take
the server down. The server binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import threading
import time

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from jaxserve.entrypoints import dashboard, openapi
from jaxserve.engine.batching import SamplingParams
from jaxserve.entrypoints.chat_template import HEADER, ChatTemplates
from jaxserve.entrypoints.completion_job import Job, Payload, param_of
from jaxserve.entrypoints.engine_client import EngineClient, EngineDeadError
from jaxserve.engine.core_process import EngineFactory
from jaxserve.engine.state import engine_state
from jaxserve.entrypoints.protocol import ApiError, ChatCompletionRequest, CompletionRequest, describe, error_body
from jaxserve.entrypoints.starting_app import StartingApp
from jaxserve.entrypoints.constraints import constraint

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20


def create_app(engine_or_client, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               model_name: str | None = None, chat_template: str | None = None,
               default_max_tokens: int | None = None) -> FastAPI:
    """The app over an EngineClient (its engine in another process, or a thread); over an
    EngineFactory, whose engine process the app starts; or over an Engine object, whose loop then
    runs in a thread. The app stops what it started when it shuts down.

    `default_max_tokens` is the max_tokens of a request that sets none, within the context its
    prompt leaves; without it, a completion gets OpenAI's 16 and a chat completion the rest of the
    context."""
    if default_max_tokens is not None and (not isinstance(default_max_tokens, int) or default_max_tokens < 1):
        raise ValueError(f"default_max_tokens must be an integer >= 1, got {default_max_tokens!r}")
    owned = not isinstance(engine_or_client, EngineClient)
    if isinstance(engine_or_client, EngineFactory):
        client = EngineClient.spawn(engine_or_client)
    else:
        client = EngineClient.in_thread(engine_or_client) if owned else engine_or_client
    info = client.info
    tokenizer = info.tokenizer
    name = model_name or info.model_name
    created = int(time.time())
    templates = ChatTemplates(tokenizer, info.chat_template_source, chat_template)
    metrics = client.metrics
    auth = api_key is not None

    def room(prompt_tokens: int) -> int:
        """The tokens the context leaves after `prompt_tokens` (at least 1: a prompt that fills
        the context is answered with the 400 that names both numbers)."""
        return max(1, info.max_model_len - prompt_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if owned:
            client.stop()

    app = FastAPI(title="jaxserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions and chat completions on a jaxserve engine.")
    app.state.engine = client
    app.state.metrics = metrics
    app.openapi = lambda: app.openapi_schema or _cache(app, openapi.build(app, info.max_model_len,
                                                                           info.vocab_size, auth))

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        metrics.rejected.labels(status=str(e.status)).inc()
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        return JSONResponse(error_body(str(e.detail), "invalid_request_error"), e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request, e):
        log.exception("unhandled error in %s", request.url.path)
        metrics.rejected.labels(status="500").inc()
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), 500)

    async def authorize(request: Request):
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "authentication_error", code="invalid_api_key")

    def check_model(body) -> None:
        if body.model is not None and body.model != name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {name!r}",
                           param="model", code="model_not_found")

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: pass token ids instead of text", param="prompt")
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def truncate(ids: list[int], keep: int | None) -> list[int]:
        if keep is None:
            return ids
        keep = info.max_model_len if keep == -1 else keep
        if keep < 1:
            raise ApiError(400, "truncate_prompt_tokens must be -1 or an integer >= 1", param="truncate_prompt_tokens")
        return ids[-keep:]

    @app.get("/health", response_model=openapi.Health, responses=openapi.errors(503))
    async def health():
        if not client.alive:
            raise ApiError(503, client.not_running_message, "server_error")
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse, responses=openapi.METRICS)
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models", dependencies=[Depends(authorize)], response_model=openapi.ModelList,
             responses=openapi.errors(*([401] if auth else [])))
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "jaxserve",
                                            "max_model_len": info.max_model_len, "chat_template": templates.source}]}

    @app.get("/v1/engine/state", dependencies=[Depends(authorize)], openapi_extra=openapi.ENGINE_STATE_QUERY,
             responses=openapi.engine_state_responses(auth))
    async def engine_state_route(request: Request):
        since = request.query_params.get("since")
        if since is not None and not (since.isascii() and since.isdigit()):
            raise ApiError(400, "since must be a step number (an integer >= 0)", param="since")
        try:
            state = await client.call(engine_state, None if since is None else int(since))
        except EngineDeadError as e:
            raise ApiError(503, str(e), "server_error")
        return JSONResponse(state)

    dashboard.add_routes(app, auth)

    @app.post("/v1/completions", dependencies=[Depends(authorize)],
              openapi_extra=openapi.request_body(CompletionRequest),
              responses=openapi.generation_responses(openapi.Completion, openapi.Completion, auth))
    async def completions(request: Request):
        arrival = time.monotonic()
        body = await _parse(request, CompletionRequest, max_body_bytes)
        check_model(body)
        texts = _completion_prompts(body.prompt)
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "echo with logprobs is not supported (prompt logprobs are not computed)",
                           param="echo")
        add_special = body.add_special_tokens is not False
        prompts = [truncate(encode(p, add_special) if isinstance(p, str) else p, body.truncate_prompt_tokens)
                   for p in texts]
        echo = [(p if isinstance(p, str) else tokenizer.decode(p) if tokenizer else "") if body.echo else ""
                for p in texts]
        max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = min(default_max_tokens, room(max(map(len, prompts)))) if default_max_tokens else 16
        params = _sampling(body, max_tokens, body.logprobs,
                           info.vocab_size, constraint(body, chat=False)[0])
        payload = Payload(prompts, params, body.n, echo, chat=False, logprobs=body.logprobs is not None,
                          include_stop=bool(body.include_stop_str_in_output), request_id=body.request_id,
                          cache_salt=body.cache_salt)
        job = Job(client, request, name, payload, tokenizer, arrival)
        return await job.respond(bool(body.stream), body.include_usage, body.continuous_usage)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)],
              openapi_extra=openapi.request_body(ChatCompletionRequest),
              responses=openapi.generation_responses(openapi.ChatCompletion, openapi.ChatCompletionChunk, auth, {HEADER: {
                  "description": "the chat template used: model, file:NAME, request, or builtin:NAME when the "
                                 "model has none of its own", "required": True, "schema": {"type": "string"}}}))
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        body = await _parse(request, ChatCompletionRequest, max_body_bytes)
        check_model(body)
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
            text, source = templates.render(messages, body.add_generation_prompt is not False, body.chat_template,
                                            variables)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages")
        prompt = truncate(encode(text, bool(body.add_special_tokens)), body.truncate_prompt_tokens)
        if not prompt:
            raise ApiError(400, "the rendered chat is empty", param="messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = min(default_max_tokens or info.max_model_len, room(len(prompt)))
        params = _sampling(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None, info.vocab_size,
                           structured)
        payload = Payload([prompt], params, body.n, [""], chat=True, logprobs=bool(body.logprobs),
                          include_stop=bool(body.include_stop_str_in_output), request_id=body.request_id,
                          cache_salt=body.cache_salt, tool_calls=tool_calls)
        job = Job(client, request, name, payload, tokenizer, arrival)
        return await job.respond(bool(body.stream), body.include_usage, body.continuous_usage, {HEADER: source})

    return app


def _cache(app: FastAPI, doc: dict) -> dict:
    app.openapi_schema = doc
    return doc


# ---- request parsing ----

async def _parse(request: Request, model, max_bytes: int):
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


# ---- command line ----

def run(args, client: EngineClient, start: float) -> None:
    """`jaxserve serve` over an engine process already started (`client`, at `start`): serves HTTP
    until SIGTERM or SIGINT, then drains (jaxserve/entrypoints/shutdown.py) and stops the engine process."""
    import uvicorn

    from jaxserve.entrypoints.shutdown import AFTER_ABORT_S, DrainGate, DrainingServer

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("serving on %s without --api-key: anyone who can reach it can use it", args.host)
    app = StartingApp(client)  # answers 503 with the start-up's progress until the engine is ready
    gate = DrainGate(app)
    server = DrainingServer(uvicorn.Config(gate, host=args.host, port=args.port, log_level="info",
                                           timeout_graceful_shutdown=AFTER_ABORT_S),
                            gate, client, args.shutdown_timeout)

    stopping = threading.Event()

    def give_up(why: str) -> None:  # no engine restart left: exit non-zero, for a supervisor to take over
        app.failed = why
        server.should_exit = True
    client.supervisor.on_give_up = give_up

    def when_ready():
        try:
            client.wait_ready()
            app.app = create_app(client, api_key=args.api_key, chat_template=args.chat_template,
                                 default_max_tokens=args.default_max_tokens)
        except Exception as e:  # noqa: BLE001 — reported, and the server stops with an error
            if not stopping.is_set():
                app.failed = str(e)
                server.should_exit = True
            return
        log.info("engine process ready (%s) in %.1f s", client.info.model_name, time.perf_counter() - start)
    threading.Thread(target=when_ready, name="jaxserve-starting", daemon=True).start()
    try:
        server.run()
    finally:
        stopping.set()
        client.stop()
    if app.failed:
        raise RuntimeError(app.failed)
