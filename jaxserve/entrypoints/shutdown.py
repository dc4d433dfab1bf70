"""Graceful shutdown of `jaxserve serve`: the first SIGTERM or SIGINT drains, the second stops at once.

    signal ─► DrainGate answers every new request 503 (`shutting_down`); those in flight go on
           ─► all of them done, or `--shutdown-timeout` seconds passed: the rest end with `error`
              (a stream: an error event, then [DONE]) and the engine aborts them, freeing their pages
           ─► uvicorn's own shutdown ─► server.run stops the engine process ─► exit 0

The drain runs before uvicorn's shutdown, not inside it, because that shutdown starts by closing
the listening socket: a request arriving then would find the port closed instead of a 503.
uvicorn's `timeout_graceful_shutdown` is left only as a bound on responses still open after the
abort (a client that stopped reading its stream).
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn
from fastapi.responses import JSONResponse

from jaxserve.entrypoints.protocol import error_body

log = logging.getLogger(__name__)

AFTER_ABORT_S = 5.0  # uvicorn's timeout_graceful_shutdown: how long a response may stay open after the abort


class DrainGate:
    """The ASGI app in front of the server's: counts the HTTP requests in flight and, once
    `closed`, answers every new one 503."""

    def __init__(self, app):
        self.app = app
        self.closed = False
        self.in_flight = 0
        self.idle = asyncio.Event()  # set while nothing is in flight
        self.idle.set()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":  # lifespan
            return await self.app(scope, receive, send)
        if self.closed:
            body = error_body("the server is shutting down", "server_error", code="shutting_down")
            return await JSONResponse(body, 503)(scope, receive, send)
        self.in_flight += 1
        self.idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()


class DrainingServer(uvicorn.Server):
    """uvicorn with the shutdown described above, over `gate` (its app) and the engine `client`."""

    def __init__(self, config: uvicorn.Config, gate: DrainGate, client, shutdown_timeout: float):
        super().__init__(config)
        self.gate, self.client, self.shutdown_timeout = gate, client, shutdown_timeout
        self.signals = 0
        self._draining: asyncio.Future | None = None

    def handle_exit(self, sig: int, frame) -> None:
        # Replaces uvicorn's handler, which would close the port at once and, once stopped,
        # re-raise the signal so that the process dies by it instead of exiting 0. A signal
        # handler runs between two bytecodes of the event loop's thread (which may hold the
        # client's lock): the work is handed to the loop.
        self.signals += 1
        work = self._drain if self.signals == 1 else self._stop_now
        asyncio.get_running_loop().call_soon_threadsafe(work, signal.Signals(sig).name)

    def _drain(self, name: str) -> None:
        log.info("%s: answering new requests 503; waiting up to %g s for the %d in flight (a second signal "
                 "stops at once)", name, self.shutdown_timeout, self.gate.in_flight)
        self.gate.closed = True
        self._draining = asyncio.ensure_future(self._wait_then_exit())  # held: the loop keeps only weak references

    async def _wait_then_exit(self) -> None:
        try:
            await asyncio.wait_for(self.gate.idle.wait(), self.shutdown_timeout)
            log.info("every request in flight has finished")
        except asyncio.TimeoutError:
            log.warning("%d requests still in flight after %g s: ending them", self.gate.in_flight,
                        self.shutdown_timeout)
            self.client.fail_all(f"the server shut down before this request finished "
                                 f"(--shutdown-timeout {self.shutdown_timeout:g} s)")
        self.should_exit = True

    def _stop_now(self, name: str) -> None:
        log.warning("%s again: stopping now", name)
        self.gate.closed = True
        self.client.fail_all("the server was stopped before this request finished")
        self.should_exit = self.force_exit = True
