"""The OpenAI-compatible HTTP server (FastAPI).

    POST /v1/completions, /v1/chat/completions
      read the body (413 past max_body_bytes) ─► pydantic model (400) ─► SamplingParams (400)
      ─► AsyncEngine.submit: the loop thread adds every prompt x n as one group (400/429)
      ─► Deltas (token ids, logprobs) ─► detokenize here, apply stop strings
      ─► one JSON response, or SSE chunks ending in `data: [DONE]`
    GET /v1/models, /health (503 once the engine loop has died), /metrics (Prometheus text)

A client that disconnects aborts its requests, so their KV pages are freed at once. Every error
is an OpenAI envelope `{"error": {"message", "type", "param", "code"}}`, and no request can take
the server down. The server binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from jaxserve.async_engine import AsyncEngine, EngineDeadError
from jaxserve.batching import SamplingParams
from jaxserve.engine import QueueFullError
from jaxserve.protocol import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, describe, error_body
from jaxserve.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = (
            status, message, type_, param, code, headers)


def create_app(engine_or_loop, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               model_name: str | None = None) -> FastAPI:
    """The app over an Engine (a loop thread is started and owned by the app) or an AsyncEngine."""
    owned = not isinstance(engine_or_loop, AsyncEngine)
    loop_engine = AsyncEngine(engine_or_loop) if owned else engine_or_loop
    loop_engine.start()
    engine = loop_engine.engine
    name = model_name or getattr(engine, "model_name", "model")
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if owned:
            await asyncio.to_thread(loop_engine.stop)

    app = FastAPI(title="jaxserve", lifespan=lifespan)
    app.state.engine = loop_engine
    app.state.metrics = metrics = loop_engine.metrics

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        if e.status >= 400:
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

    @app.get("/health")
    async def health():
        if not loop_engine.alive:
            raise ApiError(503, f"the engine loop is not running ({loop_engine.error!r})", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "jaxserve", "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest, max_body_bytes)
        check_model(body)
        prompts = _completion_prompts(body.prompt)
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "echo with logprobs is not supported (prompt logprobs are not computed)",
                           param="echo")
        params = _sampling(body, body.max_tokens if body.max_tokens is not None else 16, body.logprobs)
        tokenizer = engine.tokenizer
        echo = [(p if isinstance(p, str) else tokenizer.decode(p) if tokenizer else "") if body.echo else ""
                for p in prompts]
        job = _Job(loop_engine, request, "cmpl", name, prompts, params, body.n, body.stop_list, tokenizer,
                   chat=False, logprobs=body.logprobs is not None, echo=echo)
        return await job.respond(body.stream, body.include_usage)

    template_env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template_env.globals["raise_exception"] = _raise_template_error
    templates: dict[str, object] = {}  # the tokenizer's chat template, compiled once

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request):
        body = await _parse(request, ChatCompletionRequest, max_body_bytes)
        check_model(body)
        tokenizer = engine.tokenizer
        if tokenizer is None or not tokenizer.chat_template:
            raise ApiError(400, f"the model {name!r} has no chat template; use /v1/completions", param="messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        try:
            if tokenizer.chat_template not in templates:
                templates[tokenizer.chat_template] = template_env.from_string(tokenizer.chat_template)
            text = templates[tokenizer.chat_template].render(
                messages=[{"role": m.role, "content": m.text, **({"name": m.name} if m.name else {})}
                          for m in body.messages],
                add_generation_prompt=True, bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "")
        except Exception as e:  # noqa: BLE001 — a template refusing the conversation is the client's error
            raise ApiError(400, f"the chat template could not render these messages: {e}", param="messages")
        prompt = tokenizer.encode(text, add_special_tokens=False)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, engine.max_model_len - len(prompt))
        params = _sampling(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        job = _Job(loop_engine, request, "chatcmpl", name, [prompt], params, body.n, body.stop_list, tokenizer,
                   chat=True, logprobs=bool(body.logprobs), echo=[""])
        return await job.respond(body.stream, body.include_usage)

    return app


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
        message, param = describe(e)
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


def _sampling(body, max_tokens: int, logprobs: int | None) -> SamplingParams:
    given = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p") if getattr(body, k) is not None}
    try:
        return SamplingParams(max_tokens=max_tokens, seed=body.seed, stop=body.stop_list,
                              stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=bool(body.ignore_eos),
                              logprobs=logprobs, **given)
    except ValueError as e:
        raise ApiError(400, str(e), param=_param_of(str(e)))


def _raise_template_error(message):
    raise ValueError(message)


# ---- one request's choices ----

class _Choice:
    """Detokenized output of one engine request, with stop strings applied like the engine does."""

    def __init__(self, tokenizer, stop: tuple[str, ...], logprobs: bool):
        self.tokenizer, self.stop, self.want_logprobs = tokenizer, stop, logprobs
        self.detok: IncrementalDetokenizer | None = None
        self.context: list[int] = []  # last few ids, for the text of alternative tokens
        self.text = ""  # all generated text (before stop strings are cut)
        self.token_ids: list[int] = []
        self.pieces: list[str] = []  # per-token text, for logprobs
        self.offsets: list[int] = []
        self.logprobs: list[dict] = []
        self.tops: list[list[tuple[str, float]]] = []
        self.finish_reason: str | None = None
        self.num_prompt_tokens = 0
        self.emitted = 0  # characters of output text already streamed
        self.emitted_tokens = 0

    def add(self, delta) -> None:
        if delta.prompt_token_ids is not None:
            self.num_prompt_tokens = len(delta.prompt_token_ids)
            self.context = delta.prompt_token_ids[-4:]
            if self.tokenizer is not None:
                self.detok = IncrementalDetokenizer(self.tokenizer, delta.prompt_token_ids)
        for i, token in enumerate(delta.token_ids):
            piece = self.detok.add([token]) if self.detok else ""
            if self.want_logprobs:
                lp = delta.logprobs[i] if delta.logprobs else {"logprob": None, "top": []}
                self.offsets.append(len(self.text))
                self.pieces.append(piece if self.detok else f"token_id:{token}")
                self.logprobs.append(lp)
                base = self.tokenizer.decode(self.context) if self.tokenizer else ""
                self.tops.append([(self._token_text(base, t), v) for t, v in lp["top"]])
                self.context = (self.context + [token])[-4:]
            self.text += piece
            self.token_ids.append(token)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    def _token_text(self, base: str, token: int) -> str:
        """The text `token` adds after the recent context (whose text is `base`)."""
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode(self.context + [token])[len(base):]

    @property
    def final_text(self) -> str:
        cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=None)
        return self.text if cut is None else self.text[:cut]

    def new_text(self) -> str:
        """Text not yet streamed that is safe to send (a possible stop-string start is held back)."""
        text = self.final_text
        if self.finish_reason is None and self.stop:
            text = text[: len(text) - (max(map(len, self.stop)) - 1)]
        new = text[self.emitted:]
        self.emitted = max(self.emitted, len(text))
        return new

    def completion_logprobs(self, start: int, end: int, base: int = 0) -> dict:
        return {"tokens": self.pieces[start:end], "token_logprobs": [lp["logprob"] for lp in self.logprobs[start:end]],
                "top_logprobs": [_first_of_each(top) for top in self.tops[start:end]],
                "text_offset": [base + o for o in self.offsets[start:end]]}

    def chat_logprobs(self, start: int, end: int) -> dict:
        def entry(text, logprob):
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return {"content": [{**entry(self.pieces[i], self.logprobs[i]["logprob"]),
                             "top_logprobs": [entry(t, v) for t, v in self.tops[i]]} for i in range(start, end)]}


class _Job:
    """One HTTP payload: prompts x n engine requests, answered as JSON or as an SSE stream."""

    def __init__(self, loop_engine: AsyncEngine, request: Request, kind: str, model: str, prompts: list,
                 params: SamplingParams, n: int, stop, tokenizer, chat: bool, logprobs: bool, echo: list[str]):
        if len(prompts) * n > MAX_CHOICES:
            raise ApiError(400, f"{len(prompts)} prompts x n={n} exceeds {MAX_CHOICES} choices per request", param="n")
        self.loop_engine, self.request, self.model, self.chat, self.want_logprobs = (
            loop_engine, request, model, chat, logprobs)
        self.id = f"{kind}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = n
        self.prompts = [p for p in prompts for _ in range(n)]
        self.params = [params if params.seed is None else _with_seed(params, (params.seed + j) % 2**32)
                       for _ in prompts for j in range(n)]
        self.echo = [e for e in echo for _ in range(n)]
        self.choices = [_Choice(tokenizer, stop, logprobs) for _ in self.prompts]
        self.ids: list[str] = []
        self.queue: asyncio.Queue | None = None

    async def respond(self, stream: bool, include_usage: bool):
        try:
            self.ids, self.queue = await self.loop_engine.submit(self.prompts, self.params, prefix=self.id)
        except ValueError as e:
            raise ApiError(400, str(e), param=_param_of(str(e)))
        except QueueFullError as e:
            raise ApiError(429, f"the server is busy: {e}", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})
        except EngineDeadError as e:
            raise ApiError(503, str(e), "server_error")
        if stream:
            return _Stream(self._events(include_usage), lambda: self.loop_engine.abort(self._unfinished()),
                           media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._collect()

    def _unfinished(self) -> list[str]:
        return [i for i, c in zip(self.ids, self.choices) if c.finish_reason is None]

    async def _collect(self) -> dict:
        gone = asyncio.ensure_future(_disconnected(self.request))
        try:
            while self._unfinished():
                if self.queue.empty():
                    get = asyncio.ensure_future(self.queue.get())
                    await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if not get.done():
                        get.cancel()
                        return Response(status_code=499)  # nobody is listening any more
                    self.choices[get.result().index].add(get.result())
                while not self.queue.empty():
                    delta = self.queue.get_nowait()
                    self.choices[delta.index].add(delta)
        finally:
            gone.cancel()
            self.loop_engine.abort(self._unfinished())
        if any(c.finish_reason == "error" for c in self.choices):
            raise ApiError(500, "the engine failed while generating this request", "server_error")
        out = []
        for i, c in enumerate(self.choices):
            if self.chat:
                out.append({"index": i, "message": {"role": "assistant", "content": c.final_text},
                            "logprobs": c.chat_logprobs(0, len(c.token_ids)) if self.want_logprobs else None,
                            "finish_reason": c.finish_reason})
            else:
                out.append({"index": i, "text": self.echo[i] + c.final_text, "finish_reason": c.finish_reason,
                            "logprobs": c.completion_logprobs(0, len(c.token_ids)) if self.want_logprobs else None})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out, "usage": self._usage()}

    def _usage(self) -> dict:
        prompt = sum(c.num_prompt_tokens for c in self.choices[:: self.n])
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _chunk(self, choices: list[dict], include_usage: bool, usage=None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    async def _events(self, include_usage: bool):
        try:
            for i, echo in enumerate(self.echo):
                if self.chat:
                    yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                        "finish_reason": None}], include_usage)
                elif echo:
                    yield self._chunk([{"index": i, "text": echo, "logprobs": None, "finish_reason": None}],
                                      include_usage)
            while self._unfinished():
                delta = await self.queue.get()
                c = self.choices[delta.index]
                c.add(delta)
                if c.finish_reason == "error":
                    yield f"data: {json.dumps(error_body('the engine failed while generating', 'server_error'))}\n\n"
                    continue
                text, start, end = c.new_text(), c.emitted_tokens, len(c.token_ids)
                c.emitted_tokens = end
                if not text and start == end and c.finish_reason is None:
                    continue
                if self.chat:
                    logprobs = c.chat_logprobs(start, end) if self.want_logprobs else None
                    choice = {"index": delta.index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                              "finish_reason": c.finish_reason}
                else:
                    base = len(self.echo[delta.index])
                    logprobs = c.completion_logprobs(start, end, base) if self.want_logprobs else None
                    choice = {"index": delta.index, "text": text, "logprobs": logprobs,
                              "finish_reason": c.finish_reason}
                yield self._chunk([choice], include_usage)
            if include_usage:
                yield self._chunk([], True, self._usage())
            yield "data: [DONE]\n\n"
        finally:
            self.loop_engine.abort(self._unfinished())


class _Stream(StreamingResponse):
    """Closes the event generator however the response ends, so a vanished client's requests
    are aborted even where the ASGI server reports the disconnect through a failed send."""

    def __init__(self, events, cleanup, **kwargs):
        super().__init__(events, **kwargs)
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.cleanup()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _first_of_each(top: list[tuple[str, float]]) -> dict[str, float]:
    """{text: logprob}, best first; tokens that print the same text keep the likeliest one."""
    out: dict[str, float] = {}
    for text, logprob in top:
        out.setdefault(text, logprob)
    return out


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed)


_PARAMS = {"prompt", "max_tokens", "stop", "stop_token_ids", "seed", "temperature", "top_p", "top_k", "min_p",
           "logprobs"}


def _param_of(message: str) -> str | None:
    """The request field an engine ValueError names (its messages start with it)."""
    words = message.replace(":", " ").split()
    if len(words) > 1 and words[0] == "prompt" and words[1].isdigit():  # "prompt 2: ..." of a list
        words = words[2:]
    first = words[0] if words else ""
    return first if first in _PARAMS else "prompt" if "prompt" in message else None


# ---- command line ----

def run(args) -> None:
    """`jaxserve serve`: loads the model, then serves until interrupted."""
    import uvicorn

    from jaxserve.cli import engine_config
    from jaxserve.engine import Engine
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("serving on %s without --api-key: anyone who can reach it can use it", args.host)
    start = time.perf_counter()
    engine = Engine.from_pretrained(args.model, engine_config(args).replace(max_waiting=args.max_waiting))
    log.info("loaded %s in %.1f s", engine.model_name, time.perf_counter() - start)
    uvicorn.run(create_app(engine, api_key=args.api_key), host=args.host, port=args.port, log_level="info")
