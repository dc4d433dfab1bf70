"""OpenAI completions over HTTP, for the load scripts: one request read as it comes (`send`); many
of them a bounded number at a time within a deadline (`run_pool`), all at once (`start_all`,
`settle`), or one after another until one gets some answer (`probe`); and the server's /metrics."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from typing import Callable, Iterator

import httpx


class Call:
    """One request to `path` and what came back, filled in as it arrives. A streamed body
    (`"stream": true`, or `stream=True` for a body encoded ahead) is read event by event, and
    closed by the client after `cancel_after` events if that is set."""

    def __init__(self, path: str, body: dict | bytes, kind: str = "", cancel_after: int | None = None,
                 stream: bool | None = None):
        self.path, self.body, self.kind, self.cancel_after = path, body, kind, cancel_after
        self.stream = stream
        self.status: int | None = None  # the HTTP status
        self.headers: dict[str, str] = {}
        self.error: str | None = None  # what broke the exchange: a connection error, a malformed answer
        self.answer: dict | None = None  # a non-streamed answer's JSON
        self.text = ""  # the start of a non-streamed or refused answer
        self.chunks: list[dict] = []  # the stream's events, [DONE] aside
        self.done = False  # the stream ended with [DONE]
        self.after_done = False  # an event came after [DONE]
        self.cancelled = False  # the client closed the stream after cancel_after events
        self.start = self.first = self.end = math.nan  # time.monotonic(); first: the first choice
        self.first_seen = asyncio.Event()  # set at the first event, or at the end

    @property
    def streamed(self) -> bool:
        if self.stream is not None:
            return self.stream
        return isinstance(self.body, dict) and bool(self.body.get("stream"))

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float:
        return self.first - self.start

    def ended_as(self) -> str:
        """How the request ended, in a few words: an exception's name, `HTTP <status> <error code>`,
        or for a 200 `error event`, `cancelled`, `[DONE]`, `no [DONE]` (streams) or `200`."""
        if self.error or self.status != 200:
            code = ((self.answer or {}).get("error") or {}).get("code") if isinstance(self.answer, dict) else None
            return self.error.split(":")[0] if self.error else f"HTTP {self.status}" + (f" {code}" if code else "")
        if self.streamed:
            return "error event" if self.errors() else "cancelled" if self.cancelled else \
                "[DONE]" if self.done else "no [DONE]"
        return "200"

    def errors(self) -> list:
        return [c["error"] for c in self.chunks if "error" in c]

    def usage(self) -> dict | None:
        found = [c["usage"] for c in ([self.answer] if self.answer else self.chunks) if c.get("usage")]
        return found[-1] if found else None

    def tokens(self) -> int:
        return (self.usage() or {}).get("completion_tokens", 0)

    def choices(self) -> dict[int, dict]:
        """Each choice's text, finish_reason and whether logprobs came with it, by index, from
        the answer or from the stream's chunks (completions and chat alike)."""
        pieces = (self.answer or {}).get("choices") or [c for chunk in self.chunks for c in chunk.get("choices") or ()]
        out: dict[int, dict] = {}
        for c in pieces:
            o = out.setdefault(c["index"], {"text": "", "finish_reason": None, "logprobs": False})
            o["text"] += c.get("text") or (c.get("message") or c.get("delta") or {}).get("content") or ""
            o["finish_reason"] = c.get("finish_reason") or o["finish_reason"]
            o["logprobs"] |= c.get("logprobs") is not None
        return out


async def send(client: httpx.AsyncClient, call: Call) -> Call:
    """Sends `call` and fills it in; never raises for what the server or the connection does."""
    call.start = time.monotonic()
    try:
        if call.streamed:
            await _read_stream(client, call)
        else:
            raw = isinstance(call.body, bytes)
            r = await client.post(call.path, content=call.body if raw else None, json=None if raw else call.body,
                                  headers={"content-type": "application/json"})
            call.status, call.headers, call.text = r.status_code, dict(r.headers), r.text[:300]
            call.answer = r.json()
    except (httpx.HTTPError, OSError) as e:
        call.error = f"{type(e).__name__}: {e}"
    except (ValueError, KeyError, TypeError) as e:
        call.error = f"malformed answer: {type(e).__name__}: {e}"
    finally:
        call.end = time.monotonic()
        call.first_seen.set()
    return call


async def _read_stream(client: httpx.AsyncClient, call: Call) -> None:
    raw = isinstance(call.body, bytes)  # encoded ahead: a large body's encoding is the sender's work
    async with client.stream("POST", call.path, content=call.body if raw else None, json=None if raw else call.body,
                             headers={"content-type": "application/json"}) as r:
        call.status, call.headers = r.status_code, dict(r.headers)
        if r.status_code != 200:
            raw = (await r.aread()).decode(errors="replace")
            call.text, call.answer = raw[:300], json.loads(raw)  # the error body
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            call.first_seen.set()
            if line == "data: [DONE]":
                call.done = True
                continue
            call.after_done |= call.done
            chunk = json.loads(line[6:])
            call.chunks.append(chunk)
            if chunk.get("choices") and math.isnan(call.first):
                call.first = time.monotonic()
            if call.cancel_after is not None and len(call.chunks) >= call.cancel_after:
                call.cancelled = True
                return  # leaving the block closes the connection mid-stream


async def run_pool(client: httpx.AsyncClient, calls: Iterator[Call], concurrency: int, until: float,
                   grace: float = 0.0, ended: list[Call] | None = None) -> tuple[list[Call], int]:
    """Sends `calls`, `concurrency` at a time (a closed loop: each that ends makes room for the
    next), starting none after time.monotonic() `until` (math.inf: no deadline); those still
    running `grace` seconds after it are cancelled. Returns the calls that ended (appended to
    `ended` as they end) and how many were cancelled."""
    ended = [] if ended is None else ended

    async def worker():
        while time.monotonic() < until:
            call = next(calls, None)
            if call is None:
                return
            ended.append(await send(client, call))

    workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
    return ended, await settle(workers, None if until == math.inf else max(0.0, until - time.monotonic()) + grace)


async def start_all(client: httpx.AsyncClient, calls: list[Call], timeout: float) -> list[asyncio.Future]:
    """Sends all `calls` at once; returns their tasks once each has had its first event (or ended)."""
    tasks = [asyncio.ensure_future(send(client, call)) for call in calls]
    await asyncio.wait_for(asyncio.gather(*(call.first_seen.wait() for call in calls)), timeout)
    return tasks


async def settle(tasks: list[asyncio.Future], timeout: float | None) -> int:
    """Waits up to `timeout` seconds (None: no limit) for `tasks`; cancels those still running and
    returns how many there were."""
    _, hung = await asyncio.wait(tasks, timeout=timeout)
    for task in hung:
        task.cancel()
    await asyncio.gather(*hung, return_exceptions=True)
    return len(hung)


async def probe(client: httpx.AsyncClient, body: dict, stop: Callable[[Call], bool], timeout: float,
                pause: float, label: Callable[[Call], str] = Call.ended_as) -> tuple[float | None, dict, Call]:
    """Completions of `body` one after another, `pause` apart, until `stop(call)` or `timeout`
    seconds: (the seconds until the stopping one ended or None, how many got what by `label`, the
    last call)."""
    start, got = time.monotonic(), {}
    while True:
        call = await send(client, Call("/v1/completions", body))
        got[label(call)] = got.get(label(call), 0) + 1
        if stop(call) or time.monotonic() - start > timeout:
            return (call.end - start if stop(call) else None), got, call
        await asyncio.sleep(pause)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    """Every sample of /metrics (Prometheus text), by its name with labels."""
    text = (await client.get("/metrics", timeout=30)).text
    return {m[0]: float(m[1]) for m in re.findall(r"^([^#\s]\S*) (\S+)$", text, re.M)}


def busy(m: dict[str, float]) -> float:
    """KV pages held by sequences, plus requests running or waiting."""
    return sum(m.get(k, math.nan) for k in ("jaxserve_kv_pages_used", "jaxserve_num_requests_running",
                                             "jaxserve_num_requests_waiting"))


async def wait_idle(client: httpx.AsyncClient, timeout: float) -> tuple[dict[str, float], float]:
    """Polls /metrics until no request runs or waits and no KV page is held by a sequence, or
    until `timeout`; returns the last metrics and the seconds waited."""
    start = time.monotonic()
    while True:
        m = await metrics(client)
        if busy(m) == 0 or time.monotonic() - start > timeout:
            return m, time.monotonic() - start
        await asyncio.sleep(0.1)
