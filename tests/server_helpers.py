"""Helpers of the server tests: uvicorn on loopback in a thread, `jaxserve serve` in a subprocess,
reading /metrics, and checking a response against the served OpenAPI document."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import uvicorn

MAX_MODEL_LEN = 256
STREAMS = 4  # of `streams_in_flight`
LONG = MAX_MODEL_LEN - 16  # tokens each of them asks for: many steps, so they still run when the test acts


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 (a free port) in a background thread."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """`jaxserve serve` in a subprocess on loopback (with `args` after the usual ones), once its
    /health says 200; `new_session` puts it in a process group of its own, as a shell does."""

    def __init__(self, model: str, log_path: str, cache_dir: str | None = None, args: tuple[str, ...] = (),
                 new_session: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        env = dict(os.environ, **({"JAXSERVE_CACHE": cache_dir} if cache_dir else {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--model", model, "--port", str(self.port),
             "--max-slots", "16", "--page-size", "8", "--num-pages", "512", "--max-model-len", str(MAX_MODEL_LEN),
             *args], stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=new_session)
        self.starting: list[dict] = []  # the 503 bodies /health answered while the engine started
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None, open(log_path).read()
            try:
                health = httpx.get(self.url + "/health", timeout=2)
                if health.status_code == 200:
                    break
                self.starting.append(health.json())
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "jaxserve serve did not start"
            time.sleep(0.2)

    def engine_process(self) -> psutil.Process:
        children = psutil.Process(self.proc.pid).children()
        return next(c for c in children if "spawn_main" in " ".join(c.cmdline()))

    def output(self) -> str:
        """What the server has written so far (also after `close`)."""
        with open(self.log_path) as f:
            return f.read()

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r"^(\S+) (\S+)$", text, re.M)}


def response_validator(server, path: str, status: str = "200", method: str = "get"):
    """A JSON Schema validator of what the server's own /openapi.json says `method path` answers
    with `status` as JSON (Open API 3.1: JSON Schema 2020-12, its refs into the document's components)."""
    import jsonschema
    doc = httpx.get(server.url + "/openapi.json").json()
    schema = doc["paths"][path][method]["responses"][status]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


def wait_idle(server, timeout=20.0) -> dict[str, float]:
    """Waits until the server holds no request and no KV page; returns the metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["jaxserve_kv_pages_used"] == 0 and m["jaxserve_num_requests_running"] == 0 \
                and m["jaxserve_num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"KV pages still held: {m['jaxserve_kv_pages_used']}"
        time.sleep(0.05)


class Stream:
    """One streaming completion: its SSE data lines, read as they come."""

    def __init__(self, client: httpx.AsyncClient, i: int):
        self.events: list[str] = []
        self.started = asyncio.Event()  # the first chunk has arrived
        self.done = False
        self.task = asyncio.ensure_future(self._read(client, {
            "prompt": f"the lazy dog {i}", "max_tokens": LONG, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}))

    async def _read(self, client, body) -> None:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.started.set()
        self.done = True

    def chunks(self) -> list[dict]:
        """Every event before [DONE]."""
        return [json.loads(e) for e in self.events[:-1]]

    def finish_reasons(self) -> list[str | None]:
        return [c["choices"][0]["finish_reason"] for c in self.chunks() if c.get("choices")]

    def errors(self) -> list[dict]:
        return [c["error"] for c in self.chunks() if "error" in c]


async def streams_in_flight(client: httpx.AsyncClient) -> list[Stream]:
    streams = [Stream(client, i) for i in range(STREAMS)]
    await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in streams)), 60)
    return streams
