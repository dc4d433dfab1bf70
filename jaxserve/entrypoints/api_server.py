"""The OpenAI-compatible HTTP server (FastAPI), in the API process; the engine runs in its own.

    POST /v1/completions, /v1/chat/completions (routes.py)
      read the body (413 past max_body_bytes) ─► pydantic model (400) ─► SamplingParams (400), with the
      output's constraint (response_format, structured_outputs, tools: constraints.py)
      ─► tokenize here (chat: render the chat template first): serving_completion.py, serving_chat.py
      ─► EngineClient.submit: the engine process adds every prompt x n as one group (400/429)
      ◄─ one list of new token ids per engine step ─► detokenize here ─► JSON, or SSE chunks
    GET /v1/models, /health (503 while the engine starts, with its progress, and once it has
        died), /metrics (Prometheus text),
        /openapi.json (request bodies, responses and errors as they are: openapi.py), /docs
    GET /v1/engine/state ─► EngineClient.call(engine_state): slots, queue, pages, recent steps (JSON)
    GET /dashboard (dashboard.py): a page that polls /v1/engine/state and draws it

`create_app` only assembles: the engine client and the settings in `app.state` (app_state.py),
the routers, and the error handlers (error_handlers.py). A client that disconnects aborts its
requests, so their KV pages are freed at once. Every error is an OpenAI envelope
`{"error": {"message", "type", "param", "code"}}`, and no request can take the server down. The
server binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time

from fastapi import FastAPI

from jaxserve.engine.core_process import EngineFactory
from jaxserve.entrypoints import dashboard, openapi, routes
from jaxserve.entrypoints.app_state import DEFAULT_MAX_BODY_BYTES, ServedModel, ServerOptions
from jaxserve.entrypoints.engine_client import EngineClient
from jaxserve.entrypoints.error_handlers import add_error_handlers
from jaxserve.entrypoints.starting_app import StartingApp
from jaxserve.heap import freeze_startup_objects

__all__ = ["DEFAULT_MAX_BODY_BYTES", "create_app", "run"]

log = logging.getLogger(__name__)


def create_app(engine_or_client, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               model_name: str | None = None, chat_template: str | None = None,
               default_max_tokens: int | None = None, trust_request_chat_template: bool = False,
               tool_call_parser: str | None = None) -> FastAPI:
    """The app over an EngineClient (its engine in another process, or a thread); over an
    EngineFactory, whose engine process the app starts; or over an Engine object, whose loop then
    runs in a thread. The app stops what it started when it shuts down.

    `default_max_tokens` is the max_tokens of a request that sets none, within the context its
    prompt leaves; without it, a completion gets OpenAI's 16 and a chat completion the rest of the
    context. `tool_call_parser` (hermes, llama3_json: tool_parsers.py) reads the calls a model
    writes, which lets chat requests leave tool_choice "auto"."""
    options = ServerOptions(api_key, max_body_bytes, default_max_tokens,  # checked before an engine starts
                            trust_request_chat_template, tool_call_parser)
    owned = not isinstance(engine_or_client, EngineClient)
    if isinstance(engine_or_client, EngineFactory):
        client = EngineClient.spawn(engine_or_client)
    else:
        client = EngineClient.in_thread(engine_or_client) if owned else engine_or_client
    app = FastAPI(title="jaxserve", version="0.1.0", lifespan=_lifespan,
                  description="OpenAI-compatible completions and chat completions on a jaxserve engine.")
    app.state.engine, app.state.metrics, app.state.owns_engine = client, client.metrics, owned
    app.state.model = ServedModel.of(client.info, model_name, chat_template)
    app.state.options = options
    app.openapi = functools.partial(_openapi, app)
    add_error_handlers(app)
    for router in (routes.router, dashboard.router, routes.generation_router):
        app.include_router(router)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    yield
    if app.state.owns_engine:
        app.state.engine.stop()


def _openapi(app: FastAPI) -> dict:
    """The app's OpenAPI document, built once (openapi.py) with the served model's limits."""
    if app.openapi_schema is None:
        info = app.state.model.info
        app.openapi_schema = openapi.build(app, info.max_model_len, info.vocab_size, app.state.options.auth)
    return app.openapi_schema


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
                                 default_max_tokens=args.default_max_tokens,
                                 trust_request_chat_template=args.trust_request_chat_template,
                                 tool_call_parser=args.tool_call_parser)
            log.info("%d start-up objects frozen out of the garbage collector's passes", freeze_startup_objects())
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
