"""One HTTP payload: prompts x n engine requests, answered as one JSON body or as an SSE stream.

    token-id prompts ─► EngineClient.submit (400 / 429 / 503 before any byte is sent)
    ◄── a list of Deltas per engine step ─► detokenize here (the API process), apply stop strings
    ─► JSON: one body once every choice has finished
    ─► SSE: one write per step holding every choice's new chunk (usage in each chunk with
       `continuous_usage_stats`), a usage chunk with `include_usage`, then `data: [DONE]`

Whatever ends the response (the last token, a disconnect, a failed send), requests still running
are aborted, so their KV pages are freed at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from jaxserve.engine.batching import SamplingParams
from jaxserve.entrypoints.engine_client import EngineClient, EngineDeadError, QueueFullError
from jaxserve.entrypoints.protocol import MAX_CHOICES, ApiError, error_body
from jaxserve.entrypoints.constraints import ToolCalls
from jaxserve.engine.output_processor import OutputText
from jaxserve.tokenizer import DECODE_CONTEXT, texts_after


class Choice:
    """The output of one engine request as the server answers it: its text (output_text.py: the
    same stop-string cut as the engine's), and per-token text and logprobs when asked for."""

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...], include_stop: bool, logprobs: bool):
        self.tokenizer, self.want_logprobs = tokenizer, logprobs
        self.output = OutputText(tokenizer, prompt_ids, stop, include_stop)
        self.num_prompt_tokens = len(prompt_ids)
        self.num_cached_tokens = 0  # of the prompt, served from the prefix cache
        self.context = prompt_ids[-DECODE_CONTEXT:]  # for the text of alternative tokens
        self.pieces: list[str] = []  # per-token text, for logprobs
        self.offsets: list[int] = []
        self.logprobs: list[float | None] = []
        self.tops: list[list[tuple[str, float]]] = []
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it ended with `error`, when the API process knows
        self.emitted_tokens = 0

    @property
    def num_tokens(self) -> int:
        return self.output.num_tokens

    def add(self, token_ids: list[int], logprobs: list[dict] | None, finish_reason: str | None,
            num_cached_tokens: int, error: str | None = None) -> None:
        self.num_cached_tokens = num_cached_tokens
        if not self.want_logprobs:  # the common case: one decode for the whole step
            self.output.add(token_ids)
        else:
            for i, token in enumerate(token_ids):
                lp = logprobs[i] if logprobs else {"logprob": None, "top": []}
                self.offsets.append(len(self.output.text))
                piece = self.output.add([token])
                self.pieces.append(piece if self.tokenizer is not None else f"token_id:{token}")
                self.logprobs.append(lp["logprob"])
                texts = self._token_texts([t for t, _ in lp["top"]])
                self.tops.append([(text, v) for text, (_, v) in zip(texts, lp["top"])])
                self.context = (self.context + [token])[-DECODE_CONTEXT:]
        if finish_reason is not None:
            self.finish_reason, self.error = finish_reason, error

    def _token_texts(self, tokens: list[int]) -> list[str]:
        """The text each of `tokens` would add after the recent context."""
        if self.tokenizer is None:
            return [f"token_id:{t}" for t in tokens]
        return texts_after(self.tokenizer, self.context, [[t] for t in tokens])

    @property
    def final_text(self) -> str:
        return self.output.final_text

    def new_text(self) -> str:
        """Text not yet streamed that is safe to send."""
        return self.output.new_text(self.finish_reason is not None)

    def completion_logprobs(self, start: int, end: int, base: int = 0) -> dict:
        return {"tokens": self.pieces[start:end], "token_logprobs": self.logprobs[start:end],
                "top_logprobs": [_first_of_each(top) for top in self.tops[start:end]],
                "text_offset": [base + o for o in self.offsets[start:end]]}

    def chat_logprobs(self, start: int, end: int) -> dict:
        def entry(text, logprob):
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return {"content": [{**entry(self.pieces[i], self.logprobs[i]),
                             "top_logprobs": [entry(t, v) for t, v in self.tops[i]]} for i in range(start, end)]}


@dataclasses.dataclass
class Payload:
    """What one HTTP request asks for, once parsed and tokenized."""

    prompts: list[list[int]]  # token ids
    params: SamplingParams
    n: int
    echo: list[str]  # text to put before each prompt's choices ("" for none)
    chat: bool
    logprobs: bool
    include_stop: bool = False
    request_id: str | None = None
    cache_salt: str | None = None  # prefix-cache isolation: different salts never share pages
    tool_calls: ToolCalls | None = None  # chat: the reply is constrained to tool calls; read them back


class Job:
    """Submits a payload, then answers it as JSON or SSE."""

    def __init__(self, client: EngineClient, http_request: Request, model: str, payload: Payload, tokenizer,
                 arrival: float):
        p = payload
        if len(p.prompts) * p.n > MAX_CHOICES:
            raise ApiError(400, f"{len(p.prompts)} prompts x n={p.n} exceeds {MAX_CHOICES} choices per request",
                           param="n")
        self.client, self.http_request, self.model, self.payload, self.arrival = (
            client, http_request, model, p, arrival)
        self.id = p.request_id or f"{'chatcmpl' if p.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        prompts = [q for q in p.prompts for _ in range(p.n)]
        params = p.params
        self.params = [params if params.seed is None else dataclasses.replace(params, seed=(params.seed + j) % 2**32)
                       for _ in p.prompts for j in range(p.n)]
        self.prompts = prompts
        self.echo = [e for e in p.echo for _ in range(p.n)]
        self.choices = [Choice(tokenizer, q, params.stop, p.include_stop, p.logprobs) for q in prompts]
        self.ids: list[str] = []
        self.queue: asyncio.Queue | None = None

    async def respond(self, stream: bool, include_usage: bool, continuous_usage: bool, headers: dict | None = None):
        try:
            self.ids, self.queue = await self.client.submit(self.prompts, self.params, f"{self.id}-{uuid.uuid4().hex[:8]}",
                                                            self.arrival, cache_salt=self.payload.cache_salt)
        except ValueError as e:
            raise ApiError(400, str(e), param=param_of(str(e)))
        except QueueFullError as e:
            raise ApiError(429, f"the server is busy: {e}", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})
        except EngineDeadError as e:
            raise ApiError(503, str(e), "server_error")
        if stream:
            return _Stream(self._events(include_usage, continuous_usage), lambda: self.client.abort(self._unfinished()),
                           media_type="text/event-stream", headers={"Cache-Control": "no-cache", **(headers or {})})
        body = await self._collect()
        return body if isinstance(body, Response) else _json(body, headers)

    def _unfinished(self) -> list[str]:
        return [i for i, c in zip(self.ids, self.choices) if c.finish_reason is None]

    def _apply(self, deltas) -> set[int]:
        touched = set()
        for d in deltas:
            c = self.choices[d.index]
            if c.num_tokens == 0 and d.token_ids:
                self.client.metrics.api_ttft.observe(time.monotonic() - self.arrival)
            c.add(d.token_ids, d.logprobs, d.finish_reason, d.num_cached_tokens, d.error)
            touched.add(d.index)
        return touched

    async def _collect(self):
        gone = asyncio.ensure_future(_disconnected(self.http_request))
        try:
            while self._unfinished():
                get = asyncio.ensure_future(self.queue.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    return Response(status_code=499)  # nobody is listening any more
                self._apply(get.result())
        finally:
            gone.cancel()
            self.client.abort(self._unfinished())
        failed = next((c for c in self.choices if c.finish_reason == "error"), None)
        if failed is not None:
            if failed.error is not None:  # the engine is gone or the server is stopping: not this request's fault
                raise ApiError(503, failed.error, "server_error")
            raise ApiError(500, "the engine failed while generating this request", "server_error")
        out = []
        for i, c in enumerate(self.choices):
            if self.payload.chat:
                message, finish = self._message(c)
                out.append({"index": i, "message": message,
                            "logprobs": c.chat_logprobs(0, c.num_tokens) if self.payload.logprobs else None,
                            "finish_reason": finish})
            else:
                out.append({"index": i, "text": self.echo[i] + c.final_text, "finish_reason": c.finish_reason,
                            "logprobs": c.completion_logprobs(0, c.num_tokens) if self.payload.logprobs else None})
        return {"id": self.id, "object": "chat.completion" if self.payload.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out, "usage": self._usage()}

    def _message(self, c: Choice) -> tuple[dict, str | None]:
        """A chat choice's message and finish reason: its text, or its tool calls when the reply
        was constrained to them (and is complete JSON)."""
        calls = self.payload.tool_calls.parse(c.final_text) if self.payload.tool_calls is not None else None
        if calls is None:
            return {"role": "assistant", "content": c.final_text}, c.finish_reason
        return ({"role": "assistant", "content": None, "tool_calls": calls},
                "tool_calls" if c.finish_reason == "stop" else c.finish_reason)

    def _usage(self) -> dict:
        # A prompt counts once however many choices (n) it has: its first copy's tokens, and the
        # share of them its first copy found in the prefix cache.
        firsts = self.choices[:: self.payload.n]
        prompt = sum(c.num_prompt_tokens for c in firsts)
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in firsts)}}

    def _chunk(self, choices: list[dict], usage: dict | None, with_usage: bool) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.payload.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if with_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def _choice_chunk(self, index: int) -> dict | None:
        c = self.choices[index]
        if self.payload.tool_calls is not None:
            return self._tool_calls_chunk(index)
        text, start, end = c.new_text(), c.emitted_tokens, c.num_tokens
        c.emitted_tokens = end
        if not text and start == end and c.finish_reason is None:
            return None
        if self.payload.chat:
            logprobs = c.chat_logprobs(start, end) if self.payload.logprobs else None
            return {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                    "finish_reason": c.finish_reason}
        logprobs = c.completion_logprobs(start, end, len(self.echo[index])) if self.payload.logprobs else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def _tool_calls_chunk(self, index: int) -> dict | None:
        """A streamed reply constrained to tool calls: held back, then its calls in one delta."""
        c = self.choices[index]
        if c.finish_reason is None:
            return None
        message, finish = self._message(c)
        delta = ({"tool_calls": [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]}
                 if "tool_calls" in message else {"content": message["content"]})
        start, c.emitted_tokens = c.emitted_tokens, c.num_tokens
        logprobs = c.chat_logprobs(start, c.num_tokens) if self.payload.logprobs else None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    async def _events(self, include_usage: bool, continuous: bool):
        try:
            first, usage = [], self._usage() if continuous else None
            for i, echo in enumerate(self.echo):
                if self.payload.chat:
                    first.append(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}], usage, include_usage))
                elif echo:
                    first.append(self._chunk([{"index": i, "text": echo, "logprobs": None, "finish_reason": None}],
                                             usage, include_usage))
            if first:
                yield "".join(first)
            while self._unfinished():
                touched = self._apply(await self.queue.get())
                while not self.queue.empty():  # behind by more than one step: catch up in one write
                    touched |= self._apply(self.queue.get_nowait())
                events = []
                for index in sorted(touched):
                    if self.choices[index].finish_reason == "error":
                        why = self.choices[index].error or "the engine failed while generating"
                        events.append(f"data: {json.dumps(error_body(why, 'server_error'))}\n\n")
                        continue
                    choice = self._choice_chunk(index)
                    if choice is not None:
                        events.append(self._chunk([choice], self._usage() if continuous else None, include_usage))
                if events:
                    yield "".join(events)
            tail = self._chunk([], self._usage(), True) if include_usage else ""
            yield tail + "data: [DONE]\n\n"
        finally:
            self.client.abort(self._unfinished())


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


def _json(body: dict, headers: dict | None) -> Response:
    return Response(json.dumps(body, separators=(",", ":")), media_type="application/json", headers=headers)


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


_PARAMS = {"prompt", "max_tokens", "stop", "stop_token_ids", "seed", "temperature", "top_p", "top_k", "min_p",
           "logprobs", "structured_outputs", "response_format", "tools"}


def param_of(message: str) -> str | None:
    """The request field an engine or SamplingParams ValueError names (its messages start with it;
    a constraint's field is a dotted path, e.g. response_format.json_schema.schema)."""
    words = message.replace(":", " ").split()
    if len(words) > 1 and words[0] == "prompt" and words[1].isdigit():  # "prompt 2: ..." of a list
        words = words[2:]
    first = words[0] if words else ""
    if first.split(".")[0].split("[")[0] in _PARAMS:
        return first
    return "prompt" if "prompt" in message else None
