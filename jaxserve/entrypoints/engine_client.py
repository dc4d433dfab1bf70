"""The API process's handle on the engine core (jaxserve/engine/core_process.py), for asyncio handlers.

    handler ── submit(token ids, params) ──► commands socket ──► engine core (its own process)
    handler ◄── asyncio.Queue: one list of Deltas per step ◄── receiver thread ◄── outputs socket

`EngineClient.spawn(factory)` starts the core in a new process and waits until it is ready;
`start_process` then `wait_ready` do the same in two halves, so that the server can answer (503,
with `startup`'s progress) while it starts; `EngineClient.in_thread(engine)` runs the same loop in
a thread over an engine already built (tests, stand-in engines). The process itself, and its
replacement after a death, are the `supervisor`'s (engine_supervisor.py). One receiver thread
reads the core's one message per step and hands each subscriber's deltas to its event loop in one
wake-up per step (subscribers.py); it also updates the metrics and notices when the core dies,
which ends every request with `error` before the supervisor may start a new one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable, Sequence

import zmq

from jaxserve.engine import core_process
from jaxserve.errors import EngineDeadError, QueueFullError
from jaxserve.entrypoints.engine_channel import EngineChannel
from jaxserve.entrypoints.engine_supervisor import EngineSupervisor
from jaxserve.entrypoints.metrics import Metrics
from jaxserve.entrypoints.subscribers import Subscribers

log = logging.getLogger(__name__)


class EngineClient:
    """Submits, aborts and calls from asyncio code on any event loop; thread-safe."""

    def __init__(self, metrics: Metrics | None = None):
        self.metrics = metrics or Metrics()
        self.info: core_process.EngineInfo | None = None
        self.startup: dict = {"phase": "starting"}  # the engine's last start-up progress report
        self.error: str | None = None  # why the core died, if it did
        self.channel = EngineChannel(self)
        self.subscribers = Subscribers()
        self.supervisor = EngineSupervisor(self.channel.addrs, self.metrics)
        self._receiver: threading.Thread | None = None
        self._closing = False

    # ---- starting and stopping ----

    @classmethod
    def spawn(cls, factory: Callable[[], Any], metrics: Metrics | None = None,
              timeout: float | None = None) -> "EngineClient":
        """Starts the engine core in a new process that builds its engine with `factory()`
        (picklable, e.g. core_process.EngineFactory); returns once the engine is ready."""
        client = cls.start_process(factory, metrics)
        client.wait_ready(timeout)
        return client

    @classmethod
    def start_process(cls, factory: Callable[[], Any], metrics: Metrics | None = None,
                      restarts: int = 0, replaceable: bool = True) -> "EngineClient":
        """Starts the engine process and returns at once; `wait_ready` then waits for the engine.
        Once ready, a dead engine process is replaced by a new one up to `restarts` times within
        RESTART_WINDOW_S; at the next death `supervisor.on_give_up(why)` is called (0: no restart, no
        giving up). Not `replaceable` (one process of a multi-host group): `on_give_up` at the first death."""
        client = cls(metrics)
        client.supervisor.start_process(factory, restarts, replaceable)
        return client

    def wait_ready(self, timeout: float | None = None) -> None:
        """Waits for the engine started by `start_process`, keeping its progress in `startup`."""
        try:
            self._await_ready(timeout)
        except (RuntimeError, TimeoutError):
            self.close()
            raise
        self._receiver = threading.Thread(target=self._receive, name="jaxserve-receiver", daemon=True)
        self._receiver.start()

    @classmethod
    def in_thread(cls, engine, metrics: Metrics | None = None) -> "EngineClient":
        """Runs the engine core's loop over `engine` in a thread of this process."""
        client = cls(metrics)

        def run():
            commands, outputs = core_process.connect(client.channel.context, *client.channel.addrs)
            try:
                core_process.serve(engine, commands, outputs)
            finally:
                commands.close(linger=0)
                outputs.close(linger=1000)
        client.supervisor.start_thread(run)
        client.wait_ready()
        return client

    def _await_ready(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            while (message := self.channel.receive(200)) is None:
                if self._closing or self.supervisor.stopping:
                    raise RuntimeError("the engine did not start: stopped meanwhile")
                if not self.supervisor.alive():
                    raise RuntimeError(f"the engine did not start: {self.supervisor.exit_reason()}")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the engine did not start within {timeout} s")
            kind, payload = message
            if kind == "info":  # before the warm-up; "ready" then carries none
                if self.info is None:  # a restarted engine is the same model: its tokenizer is read
                    self.info = payload
                    if payload.tokenizer is not None:  # read here, while the engine warms up
                        payload.tokenizer.load()
            elif kind != "progress":
                break
            else:
                self.startup = payload
        if kind != "ready":
            raise RuntimeError(f"the engine did not start: {payload}")
        self.info = self.info or payload

    def stop(self, timeout: float = 30.0) -> None:
        """Aborts every request, ends the core and closes the channel."""
        reads_commands = self._receiver is not None and not self.restarting  # a starting core reads none
        self.supervisor.end((lambda: self._send(("stop",))) if reads_commands else None, timeout)
        self.close()

    def close(self) -> None:
        """Ends every request in flight with `abort` and closes the channel (the core, if still
        running, is left to notice)."""
        self._closing = True
        self.supervisor.stopping = True  # what ends now is no death: no restart
        if self._receiver is not None and self._receiver is not threading.current_thread():
            self._receiver.join(5)
        self._die(self.error or "the engine was stopped", reason="abort")
        self.channel.close()

    @property
    def alive(self) -> bool:
        """Whether requests are taken: the engine runs, and so does the thread that delivers its
        outputs (without it every request would hang)."""
        receiving = self._receiver is None or self._receiver.is_alive()
        return (self.info is not None and self.error is None and not self._closing and self.supervisor.alive()
                and receiving)

    @property
    def restarting(self) -> bool:
        """A new engine process is starting after a death (requests are refused meanwhile)."""
        return self.supervisor.restarting

    # ---- asyncio side ----

    async def submit(self, prompts: Sequence[list[int]], params: Sequence, prefix: str,
                     arrival_time: float | None = None, cache_salt: str | None = None,
                     prompt_tokens: int | None = None) -> tuple[list[str], asyncio.Queue]:
        """Queues token-id prompts as one payload (all or none); returns their request ids and the
        queue that receives their Deltas, a list per step. `prompt_tokens`: what the prompt-token
        counter adds (a prompt sampled n times counts once, as in usage); default: every prompt's.
        Raises ValueError (bad input), QueueFullError or EngineDeadError."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        ids = [f"{prefix}-{i}" for i in range(len(prompts))]
        key, future = self.subscribers.expect(loop)
        self.subscribers.subscribe(ids, loop, deltas)
        self._send(("add", key, ids, [list(p) for p in prompts], list(params), arrival_time or time.monotonic(),
                    cache_salt))
        try:
            error = await future
        except BaseException:  # cancelled, or the core died: forget (and abort) whatever was added
            self.subscribers.forget(ids)
            self.abort(ids)
            raise
        if error is not None:
            self.subscribers.forget(ids)
            kind, message = error
            raise (ValueError if kind == "invalid" else QueueFullError if kind == "busy" else RuntimeError)(message)
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts) if prompt_tokens is None else prompt_tokens)
        return ids, deltas

    def fail_all(self, why: str) -> None:
        """Ends every request in flight with `error` (its stream's error event says `why`) and
        has the engine abort them, which frees their pages; the engine serves on."""
        ended = self.subscribers.end_all(why, "error")  # ended here first: the engine's `abort` finishes reach nobody
        self.abort(ended)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Ends requests with `abort` and frees their pages; unknown or finished ids are ignored.
        Thread-safe and non-blocking."""
        if request_ids and self.alive:
            self._send(("abort", list(request_ids)))

    async def call(self, fn: Callable[..., Any], *args) -> Any:
        """Runs fn(engine, *args) on the engine's loop and returns its result; fn and args must
        pickle (a module-level function)."""
        self._check_alive()
        key, future = self.subscribers.expect(asyncio.get_running_loop())
        self._send(("call", key, fn, args))
        return await future

    def _send(self, command: tuple) -> None:
        try:
            self.channel.send(command)
        except (zmq.Again, zmq.ContextTerminated, zmq.ZMQError) as e:
            raise EngineDeadError(f"the engine cannot be reached ({e})") from None

    @property
    def not_running_message(self) -> str:
        """Why requests are refused, once not alive (the cause may reach us a moment after the death)."""
        if self.restarting:
            return f"the engine is restarting ({self.error})"
        return f"the engine is not running ({self.error})" if self.error else "the engine is not running"

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError(self.not_running_message)

    # ---- receiver thread ----

    def _receive(self) -> None:
        try:
            self._receive_loop()
        except Exception:  # noqa: BLE001 — nothing would deliver outputs any more: fail loudly, not hang
            log.exception("the thread receiving the engine's outputs failed")
            self._die("the server stopped receiving the engine's outputs")

    def _receive_loop(self) -> None:
        while not self._closing:
            try:
                message = self.channel.receive(500)
            except zmq.ZMQError:
                return
            if message is None:
                if not self.supervisor.alive():
                    if not self.supervisor.stopping:
                        self._die(self.supervisor.exit_reason())
                        if self._restart():
                            continue
                    return
                continue
            try:
                if message[0] == "batch":
                    self._on_batch(*message[1:])
                    continue
            except Exception:  # noqa: BLE001 — this batch's outputs are lost: their requests end, the rest go on
                log.exception("delivering the engine's outputs failed: the requests in flight end with error")
                self.fail_all("the server failed to deliver the engine's output")
                continue
            if message[0] == "dead":
                self._die(message[1])
                if not self._restart():
                    return

    def _restart(self) -> bool:
        """Has the supervisor replace the dead engine process; True once the new one is ready.
        Requests are refused (503) meanwhile: `alive` is false while `error` is set."""
        if not self.supervisor.restart(self.error, self._await_restarted):
            return False
        self.error = None
        return True

    def _await_restarted(self) -> None:
        self.startup = {"phase": "restarting"}
        self._await_ready(None)

    def _on_batch(self, replies: list[tuple], outputs: list[tuple], stats: dict | None) -> None:
        self.subscribers.answer(replies)
        for _, tokens, _, finish, _, timings, _ in outputs:
            self.metrics.generation_tokens.inc(len(tokens))
            if finish is not None:
                self.metrics.observe_finished(finish, timings)
        self.abort(self.subscribers.deliver(outputs))  # what could not be delivered ends in the engine too
        if stats is not None:
            self.metrics.observe_engine(stats)

    def _die(self, why: str, reason: str = "error") -> None:
        """The core has ended: records why (unless it was stopped) and ends everything in flight."""
        if self.error is None and reason == "error":
            log.error("the engine died: %s", why)
            self.error = why
        self.subscribers.end_all(f"the engine stopped ({why})", reason)
