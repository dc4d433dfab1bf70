"""Helpers of the server tests: uvicorn on loopback in a thread, and reading /metrics."""

from __future__ import annotations

import re
import socket
import threading
import time

import httpx
import uvicorn


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


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r"^(\S+) (\S+)$", text, re.M)}


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
