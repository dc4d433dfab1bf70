"""One HTTP generation request, completion or chat: prompts x n engine requests, answered as one
JSON body or as an SSE stream. What the two share is here; serving_completion.py and
serving_chat.py build the prompts and say how a choice reads.

    token-id prompts ─► EngineClient.submit (400 / 429 / 503 before any byte is sent)
    ◄── a list of Deltas per engine step ─► detokenize here (choice.py), apply stop strings
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
from jaxserve.entrypoints.choice import Choice
from jaxserve.entrypoints.engine_client import EngineDeadError, QueueFullError
from jaxserve.entrypoints.offload import answer
from jaxserve.entrypoints.protocol import MAX_CHOICES, ApiError, error_body


class Serving:
    """Submits a request's prompts, then answers it as JSON or SSE. A subclass names its objects
    and writes its choices: `final_choice`, `delta_choice` and, for a stream, `opening_choice`."""

    ID_PREFIX: str  # of a generated response id
    OBJECT: str  # the JSON body's `object`
    CHUNK_OBJECT: str  # each SSE chunk's `object`

    def __init__(self, http_request: Request, body, prompts: list[list[int]], params: SamplingParams,
                 logprobs: bool, arrival: float):
        """`body`: the parsed request (its n, stream options, ids); `prompts`: token ids, each
        answered by body.n choices; `arrival`: when the request arrived (time.monotonic)."""
        if len(prompts) * body.n > MAX_CHOICES:
            raise ApiError(400, f"{len(prompts)} prompts x n={body.n} exceeds {MAX_CHOICES} choices per request",
                           param="n")
        state = http_request.app.state
        self.client, self.model, self.http_request, self.body, self.arrival = (
            state.engine, state.model.name, http_request, body, arrival)
        self.logprobs = logprobs
        self.id = body.request_id or f"{self.ID_PREFIX}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompts = [q for q in prompts for _ in range(body.n)]
        self.params = [params if params.seed is None else dataclasses.replace(params, seed=(params.seed + j) % 2**32)
                       for _ in prompts for j in range(body.n)]
        include_stop = bool(body.include_stop_str_in_output)
        self.choices = [Choice(state.model.tokenizer, q, params.stop, include_stop, logprobs) for q in self.prompts]
        self.ids: list[str] = []
        self.queue: asyncio.Queue | None = None

    # ---- what each kind of request writes ----

    def final_choice(self, index: int) -> dict:
        """Choice `index` in the JSON body, once every choice has finished."""
        raise NotImplementedError

    def delta_choice(self, index: int, text: str, start: int, end: int) -> dict:
        """Choice `index` in a chunk: its new `text`, from tokens start..end."""
        raise NotImplementedError

    def opening_choice(self, index: int) -> dict | None:
        """Choice `index` in the stream's first write, before any token (None: not there)."""
        return None

    # ---- submitting and answering ----

    async def respond(self, headers: dict | None = None) -> Response:
        """Submits the prompts and answers: a stream when the body asks for one, else JSON."""
        try:
            prefix = f"{self.id}-{uuid.uuid4().hex[:8]}"  # of the engine's request ids
            self.ids, self.queue = await self.client.submit(
                self.prompts, self.params, prefix, self.arrival, cache_salt=self.body.cache_salt,
                prompt_tokens=sum(len(q) for q in self.prompts[:: self.body.n]))  # n choices: one prompt
        except ValueError as e:
            raise ApiError(400, str(e), param=param_of(str(e)))
        except QueueFullError as e:
            raise ApiError(429, f"the server is busy: {e}", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})
        except EngineDeadError as e:
            raise ApiError(503, str(e), "server_error")
        if self.body.stream:
            events = self._events(self.body.include_usage, self.body.continuous_usage)
            return _Stream(events, lambda: self.client.abort(self._unfinished()),
                           media_type="text/event-stream", headers={"Cache-Control": "no-cache", **(headers or {})})
        gone = await self._collect()
        if gone is not None:
            return gone
        return await answer(lambda: _json(self._body(), headers), sum(c.num_tokens for c in self.choices))

    def _unfinished(self) -> list[str]:
        return [i for i, c in zip(self.ids, self.choices) if c.finish_reason is None]

    def _apply(self, deltas) -> set[int]:
        touched = set()
        for d in deltas:
            c = self.choices[d.index]
            if c.num_tokens == 0 and d.token_ids:
                self.client.metrics.api_ttft.observe(time.monotonic() - self.arrival)
            c.add(d.token_ids, d.logprobs, d.finish_reason, d.num_cached_tokens, d.error, d.invalid)
            touched.add(d.index)
        return touched

    async def _collect(self) -> Response | None:
        """Waits for every choice to finish: None, or a 499 if the client went first (ApiError if
        a choice failed)."""
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
            if failed.invalid is not None:  # the engine found the request's own input wanting (its grammar)
                raise ApiError(400, failed.invalid, "invalid_request_error")
            if failed.error is not None:  # the engine is gone or the server is stopping: not this request's fault
                raise ApiError(503, failed.error, "server_error")
            raise ApiError(500, "the engine failed while generating this request", "server_error")
        return None

    def _body(self) -> dict:
        """The JSON body of the answer, once every choice has finished."""
        return {"id": self.id, "object": self.OBJECT, "created": self.created, "model": self.model,
                "choices": [self.final_choice(i) for i in range(len(self.choices))], "usage": self._usage()}

    def _usage(self) -> dict:
        # A prompt counts once however many choices (n) it has: its first copy's tokens, and the
        # share of them its first copy found in the prefix cache.
        firsts = self.choices[:: self.body.n]
        prompt = sum(c.num_prompt_tokens for c in firsts)
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in firsts)}}

    # ---- streaming ----

    def _chunk(self, choices: list[dict], usage: dict | None, with_usage: bool) -> str:
        body = {"id": self.id, "object": self.CHUNK_OBJECT, "created": self.created, "model": self.model,
                "choices": choices}
        if with_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def choice_chunk(self, index: int) -> dict | None:
        """Choice `index` in the next chunk: what it has added since the last (None: nothing)."""
        c = self.choices[index]
        text, start, end = c.new_text(), c.emitted_tokens, c.num_tokens
        c.emitted_tokens = end
        if not text and start == end and c.finish_reason is None:
            return None
        return self.delta_choice(index, text, start, end)

    async def _events(self, include_usage: bool, continuous: bool):
        try:
            usage = self._usage() if continuous else None
            opening = [self._chunk([choice], usage, include_usage)
                       for choice in map(self.opening_choice, range(len(self.choices))) if choice is not None]
            if opening:
                yield "".join(opening)
            while self._unfinished():
                touched = self._apply(await self.queue.get())
                while not self.queue.empty():  # behind by more than one step: catch up in one write
                    touched |= self._apply(self.queue.get_nowait())
                events = []
                for index in sorted(touched):
                    if self.choices[index].finish_reason == "error":
                        choice = self.choices[index]
                        body = error_body(choice.invalid, "invalid_request_error") if choice.invalid else \
                            error_body(choice.error or "the engine failed while generating", "server_error")
                        events.append(f"data: {json.dumps(body)}\n\n")
                        continue
                    choice = self.choice_chunk(index)
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


# ---- building a request ----

def sampling_params(body, max_tokens: int, logprobs: int | None, vocab_size: int | None,
                    structured_outputs=None) -> SamplingParams:
    """The engine's SamplingParams for a request body (400 naming the field it refuses)."""
    given = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p") if getattr(body, k) is not None}
    if given.get("top_k") == -1 or given.get("top_k", 0) >= (vocab_size or 2**31):
        given["top_k"] = 0  # -1 is vLLM's "off"; k past the vocabulary keeps every token (and fits int32)
    try:
        return SamplingParams(max_tokens=max_tokens, seed=body.seed, stop=body.stop_list,
                              stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=bool(body.ignore_eos),
                              logprobs=logprobs, structured_outputs=structured_outputs, **given)
    except ValueError as e:
        raise ApiError(400, str(e), param=param_of(str(e)))


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
