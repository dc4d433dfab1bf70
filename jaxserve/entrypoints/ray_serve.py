"""Replicas behind Ray Serve (the `jaxserve[ray]` extra; nothing else in jaxserve imports ray).

    client ─► Serve proxy ─► OpenAIIngress (FastAPI, one catch-all route): reads the body, takes its
              prompt (or chat messages) as the routing key, keeps the bytes as they came
          ─► DeploymentHandle ─► request router (PrefixCacheAffinityRouter: the replica whose
              prompts share the longest prefix with this one, while loads are balanced)
          ─► Engine replica: jaxserve.entrypoints.api_server.create_app over its own EngineClient (engine process),
              run in-process as an ASGI app ─► status, headers, body (one call; a stream for stream: true)

Why two deployments: Serve's proxy hands an HTTP ingress deployment only the ASGI scope (the body
follows once a replica is chosen), so a router attached to a FastAPI-ingress deployment sees no
prompt; Ray's PrefixCacheAffinityRouter reads `.prompt` or `.messages` of the request's first
argument (and raises when neither exists). A handle call carries the request as an argument, so
the router is attached to the engine deployment and the ingress calls it, as Ray Serve LLM does.
Every route, error and metric is the one `jaxserve serve` answers, since each replica runs the
same app; responses carry `x-jaxserve-replica`, the replica that served them.

`jaxserve serve --replicas K` runs this on a local Ray cluster (or the one `RAY_ADDRESS` names);
`serve run` takes `build_app` with a config (docs/scale-out.md).
"""

import asyncio  # no `from __future__ import annotations`: Serve's ingress must see `Request` as a class
import dataclasses
import json
import logging
import math
import os
import signal
import threading
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import RequestRouter

from jaxserve.engine.core_process import EngineFactory
from jaxserve.entrypoints.protocol import error_body
from jaxserve.entrypoints.api_server import DEFAULT_MAX_BODY_BYTES

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-jaxserve-replica"
# Ray's PrefixCacheAffinityRouter. Its public name, ray.serve.llm.request_router.PrefixCacheAffinityRouter,
# is an empty subclass of this class, but importing ray.serve.llm raises ImportError unless vLLM or
# SGLang is installed (ray[llm] pins vllm, and torch with it); this module has the same router and
# imports without them. ray is pinned in the `ray` extra, since the path is Ray's internal one.
PREFIX_ROUTER = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"
ROUTERS = ("prefix", "pow2", "round-robin")
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


@dataclasses.dataclass
class HttpCall:
    """One HTTP request as the ingress received it, sent to a replica through a handle.
    `prompt` is the routing key the prefix router reads (text; token ids one character each)."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prompt: str


def routing_key(path: str, body: bytes) -> tuple[str, bool]:
    """The text a prefix router matches: a completion's prompt(s), or a chat's message contents
    (as Ray's router joins them), "" for other routes and bodies that do not parse; and whether
    the body asks for a stream."""
    if not path.endswith("/completions") or not body:
        return "", False
    try:
        data = json.loads(body)
    except ValueError:
        return "", False
    if not isinstance(data, dict):
        return "", False
    stream = data.get("stream") is True
    if "messages" in data:
        messages = data["messages"] if isinstance(data["messages"], list) else []
        return "".join(_text(m.get("content") if isinstance(m, dict) else m) for m in messages), stream
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return prompt, stream
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], int):  # one prompt of token ids
            return token_text(prompt), stream
        return "".join(p if isinstance(p, str) else token_text(p) for p in prompt if isinstance(p, (str, list))), stream
    return "", stream


# Token id t is the character TOKEN_CHAR0 + t: past the surrogates, so any vocabulary under a
# million ids maps to valid text.
TOKEN_CHAR0, TOKEN_CHARS = 0x10000, 0x100000


def token_text(ids: list) -> str:
    """Token ids as routing text, one character per token: a token prefix is a character prefix
    (the router matches characters), and a 512-token prompt is a 512-character key, not the 3,000
    or so of decimal digits, for the router's prefix tree to insert and match. Ids that are not
    token ids (the server rejects them) become U+FFFD."""
    return "".join(chr(TOKEN_CHAR0 + t) if type(t) is int and 0 <= t < TOKEN_CHARS else "\ufffd" for t in ids)


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return ""


class RoundRobinRouter(RequestRouter):
    """Replicas in turn, whatever the prompt: the baseline the prefix router is measured against."""

    def initialize_state(self, **kwargs):
        self._turn = 0

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        self._turn += 1
        return [[ordered[self._turn % len(ordered)]]]


@serve.deployment(name="engine")
class EngineReplica:
    """One engine (its own process, as under `jaxserve serve`) and the jaxserve app over it."""

    def __init__(self, factory: EngineFactory, app_options: dict, restarts: int = 3):
        from jaxserve.entrypoints.engine_client import EngineClient
        from jaxserve.entrypoints.api_server import create_app
        logging.basicConfig(level=logging.INFO)
        self.client = EngineClient.start_process(factory, restarts=restarts)
        self.client.wait_ready()
        self.app = create_app(self.client, **app_options)
        self.replica = serve.get_replica_context().replica_id.unique_id.encode()

    async def respond(self, call: HttpCall | None = None, *, request: HttpCall | None = None):
        """Runs `call` through the app; returns (status, headers, body). `request` is the same
        call, passed by keyword where it has no prompt (the router then picks by load)."""
        parts = [part async for part in self.stream(call or request)]
        (status, headers), body = parts[0], b"".join(parts[1:])
        return status, headers, body

    async def stream(self, call: HttpCall | None = None, *, request: HttpCall | None = None):
        """Runs `call` through the app; yields (status, headers), then the body's chunks."""
        call = call or request
        sent: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        read = False

        async def receive():
            nonlocal read
            if not read:
                read = True
                return {"type": "http.request", "body": call.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def run():
            try:
                await self.app(scope, receive, sent.put)
            finally:
                await sent.put(None)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": call.method,
                 "scheme": "http", "path": call.path, "raw_path": call.path.encode(), "root_path": "",
                 "query_string": call.query_string, "headers": call.headers, "client": ("ray-serve", 0),
                 "server": ("ray-serve", 0), "state": {}}
        task = asyncio.create_task(run())
        try:
            while (message := await sent.get()) is not None:
                if message["type"] == "http.response.start":
                    yield message["status"], [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica)]
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        break
        finally:  # the client went (cancelled here) or the response ended: the app aborts what is left
            gone.set()
            await asyncio.shield(task)

    def check_health(self):
        if not self.client.alive and not self.client.restarting:
            raise RuntimeError(self.client.not_running_message)

    def __del__(self):
        client = getattr(self, "client", None)
        if client is not None:
            client.stop()


# Defined before the deployments: Serve pickles a deployment's class when it is decorated, so
# names defined below it are missing in the replica.
REPLICA_DIED = "the replica serving this request stopped"


def _replica_died(e: Exception) -> JSONResponse:
    log.warning("the replica serving a request died: %s", e)
    return JSONResponse(error_body(REPLICA_DIED, "server_error"), 503)


_ingress = FastAPI(title="jaxserve (Ray Serve ingress)", docs_url=None, redoc_url=None, openapi_url=None)


@serve.deployment(name="ingress")
@serve.ingress(_ingress)
class OpenAIIngress:
    """Forwards every request, bytes as they came, to an engine replica chosen by the router."""

    def __init__(self, engine, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.engine = engine
        self.streams = engine.options(stream=True)
        self.max_body_bytes = max_body_bytes

    @_ingress.api_route("/{path:path}", methods=METHODS, include_in_schema=False)
    async def forward(self, request: Request):
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:  # the replica's app would say the same
                return JSONResponse(error_body(f"the request body exceeds the limit of {self.max_body_bytes} bytes",
                                               "invalid_request_error", code="body_too_large"), 413)
        path = request.url.path
        key, stream = routing_key(path, bytes(body))
        call = HttpCall(request.method, path, request.scope.get("query_string", b""),
                        list(request.scope["headers"]), bytes(body), key)
        # With no prompt the call goes by keyword: the prefix router then balances by load alone
        # (it raises on a first argument without .prompt, and cannot match an empty one).
        args, kwargs = ((call,), {}) if key else ((), {"request": call})
        try:
            if not stream:  # one answer: a plain call costs less than a stream through Ray
                status, headers, content = await self.engine.respond.remote(*args, **kwargs)
                response = Response(content, status)
                response.raw_headers = headers
                return response
            chunks = self.streams.stream.remote(*args, **kwargs)
            try:
                status, headers = await chunks.__anext__()
            except BaseException:
                chunks.cancel()
                raise
        except RayActorError as e:
            return _replica_died(e)

        async def rest():
            try:
                async for chunk in chunks:
                    yield chunk
            except RayActorError as e:  # ended as a stream whose engine dies ends: an error event, then [DONE]
                log.warning("the replica serving a stream died: %s", e)
                yield f"data: {json.dumps(error_body(REPLICA_DIED, 'server_error'))}\n\ndata: [DONE]\n\n".encode()
            finally:
                chunks.cancel()  # the client has gone, or the body is done (a no-op then)
        response = StreamingResponse(rest(), status_code=status)
        response.raw_headers = headers
        return response


# Ray starts its workers at niceness 15, below its own daemons. The engine replica, and the engine
# process it starts, are the work being served: at 15 the engine lost its cores to everything else
# on a busy 2-core host (docs/scale-out.md), so the replica keeps the default priority.
ENGINE_REPLICA_ENV = {"RAY_worker_niceness": "0"}


def with_gpus(actor_options: dict, replicas: int, cluster_gpus: float, devices_per_engine: int = 1) -> dict:
    """Each replica's GPUs where its options name none. Ray hides no GPU from an actor that asks for
    none, so every engine would start on the first GPU and take most of its memory (XLA reserves
    75% of it); asking for the engine's devices gives each replica its own (CUDA_VISIBLE_DEVICES).
    Where the cluster has too few for that, the options stay as given, with a warning."""
    if "num_gpus" in actor_options or cluster_gpus <= 0:
        return actor_options
    if replicas * devices_per_engine > cluster_gpus:
        log.warning("%d replicas of %d GPU(s) each do not fit the cluster's %g GPUs: they share them; give each "
                    "engine its share of the memory (XLA_PYTHON_CLIENT_MEM_FRACTION, --kv-cache-mb) or set "
                    "num_gpus in --ray-actor-options", replicas, devices_per_engine, cluster_gpus)
        return actor_options
    return {**actor_options, "num_gpus": devices_per_engine}


def build(factory: EngineFactory, replicas: int, router: str = "prefix", api_key: str | None = None,
          chat_template: str | None = None, default_max_tokens: int | None = None,
          trust_request_chat_template: bool = False, tool_call_parser: str | None = None,
          ray_actor_options: dict | None = None, max_ongoing_requests: int = 1024, restarts: int = 3,
          router_kwargs: dict | None = None):
    """The Serve application: the ingress over `replicas` engine replicas with `router`."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    router_config = {"prefix": RequestRouterConfig(request_router_class=PREFIX_ROUTER,
                                                   request_router_kwargs=router_kwargs or {}),
                     "pow2": RequestRouterConfig(),
                     "round-robin": RequestRouterConfig(request_router_class=RoundRobinRouter)}[router]
    actor_options = {"num_cpus": 1, **(ray_actor_options or {})}
    if ray.is_initialized():  # a cluster to build for (`jaxserve serve --replicas`, `serve run`)
        mesh = factory.config.mesh if factory.config is not None else None
        actor_options = with_gpus(actor_options, replicas, ray.cluster_resources().get("GPU", 0),
                                  math.prod(mesh.values()) if mesh else 1)
    runtime_env = dict(actor_options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**ENGINE_REPLICA_ENV, **runtime_env.get("env_vars", {})}
    engine = EngineReplica.options(
        num_replicas=replicas, max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={**actor_options, "runtime_env": runtime_env},
        request_router_config=router_config,
        health_check_period_s=10, health_check_timeout_s=30,
    ).bind(factory, {"api_key": api_key, "chat_template": chat_template, "default_max_tokens": default_max_tokens,
                     "trust_request_chat_template": trust_request_chat_template,
                     "tool_call_parser": tool_call_parser},
           restarts)
    return OpenAIIngress.options(ray_actor_options={"num_cpus": 0},
                                 max_ongoing_requests=max_ongoing_requests).bind(engine)


def build_app(args: dict[str, Any]):
    """The builder `serve run` calls with a config's `args`:

        model: a checkpoint path (default: Gemma 3 270M), engine: EngineConfig fields,
        replicas, router (prefix | pow2 | round-robin), warmup, api_key, chat_template, default_max_tokens,
        tool_call_parser, ray_actor_options (e.g. {"num_cpus": 4} or {"resources": {"TPU": 4}})"""
    from jaxserve.config import EngineConfig
    args = dict(args)
    factory = EngineFactory(args.pop("model", None), EngineConfig(**args.pop("engine", {})),
                            warmup=bool(args.pop("warmup", True)))
    replicas = int(args.pop("replicas", 1))
    return build(factory, replicas, **args)


# Ray's background work on a local cluster that only serves: no idle workers started ahead, no Ray
# metrics (the dashboard that shows them is off; jaxserve's /metrics is its own), Serve's control
# loop every 0.5 s rather than 0.1 s, and its cached metrics exported every second rather than
# every 0.1 s (Serve's controller and proxy read these from the job's runtime env). Where the
# engine computes on the CPU, Ray's processes take those cycles from it (docs/scale-out.md: with
# them, 1 replica served 0.896 of direct's throughput in one interleaved run, against 0.800).
LEAN_SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False,
                      "enable_metrics_collection": False}
LEAN_SERVE_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}


def local_ray_options(num_cpus: int | None = None) -> dict:
    """ray.init's options for a local cluster kept small: no dashboard, a 256 MiB object store,
    Ray's background work trimmed (above), and workers that import this jaxserve and see the
    engine's environment."""
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: os.environ[k] for k in ("JAXSERVE_CACHE", "XLA_FLAGS", "JAX_PLATFORMS") if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH")) if p)
    return dict(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, object_store_memory=256 << 20,
                runtime_env={"env_vars": {**LEAN_SERVE_ENV, **env}}, log_to_driver=True,
                _system_config=LEAN_SYSTEM_CONFIG)


def start_serve(host: str, port: int) -> None:
    """Serve's controller and HTTP proxy on `host:port`. The proxy gets 30 s, not Ray's 5, to say it
    is ready: replicas compiling their engines keep a small machine's cores busy, and three missed
    5 s checks made Serve kill the proxy before it ever answered (seen on 2 cores)."""
    serve.start(http_options={"host": host, "port": port}, controller_options={
        "runtime_env": {"env_vars": {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}}})


def run(args, factory: EngineFactory) -> None:
    """`jaxserve serve --replicas K`: joins the cluster RAY_ADDRESS names, or starts a local one;
    serves the OpenAI routes on --host/--port until SIGTERM or SIGINT, then deletes the application
    (and, on a local cluster, shuts Serve and the cluster down)."""
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("serving on %s without --api-key: anyone who can reach it can use it", args.host)
    options = json.loads(args.ray_actor_options) if args.ray_actor_options else {}
    joined = bool(os.environ.get("RAY_ADDRESS"))
    if joined:
        ray.init(address=os.environ["RAY_ADDRESS"])
    else:
        ray.init(**local_ray_options())
    try:
        start_serve(args.host, args.port)
        app = build(factory, args.replicas, router=args.router, api_key=args.api_key,
                    chat_template=args.chat_template, default_max_tokens=args.default_max_tokens,
                    trust_request_chat_template=args.trust_request_chat_template,
                    tool_call_parser=args.tool_call_parser, ray_actor_options=options, restarts=args.engine_restarts)
        serve.run(app, name="jaxserve", route_prefix="/", blocking=False)
        log.info("%d replica(s) ready behind http://%s:%d (router: %s)", args.replicas, args.host, args.port,
                 args.router)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:  # on a cluster joined, only this application goes: Serve may run others there
        if joined:
            serve.delete("jaxserve")
        else:
            serve.shutdown()
        ray.shutdown()
