"""The API process's handle on the engine core (jaxserve/engine/core_process.py), for asyncio handlers.

    handler ── submit(token ids, params) ──► commands socket ──► engine core (its own process)
    handler ◄── asyncio.Queue: one list of Deltas per step ◄── receiver thread ◄── outputs socket

`EngineClient.spawn(factory)` starts the core in a new process (spawned, never forked, so jax
starts fresh there) and waits until it is ready; `start_process` then `wait_ready` do the same in
two halves, so that the server can answer (503, with `startup`'s progress) while it starts; `EngineClient.in_thread(engine)` runs the same loop in a thread over an
engine already built (tests, stand-in engines). One receiver thread reads the core's one message
per step and hands each subscriber's deltas to its event loop in one wake-up per step; it also
updates the metrics and notices when the core dies, which ends every request with `error`. A
process started with `restarts` is then replaced by a new one (its steps load from the compile
cache), up to that many times in RESTART_WINDOW_S; one death more and the client gives up.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

import zmq

from jaxserve.engine import core_process
from jaxserve.errors import EngineDeadError, QueueFullError
from jaxserve.entrypoints.metrics import Metrics

log = logging.getLogger(__name__)

RESTART_WINDOW_S = 600.0  # `restarts` counts the engine's restarts over the last ten minutes


@dataclasses.dataclass
class Delta:
    """New output of one request in one step; the last one has a finish_reason."""

    index: int  # the request's position in its submit() call
    token_ids: list[int]
    logprobs: list[dict] | None  # {"logprob": float, "top": [(token_id, logprob), ...]} per token
    finish_reason: str | None
    num_cached_tokens: int = 0  # of the request's prompt, served from the prefix cache
    error: str | None = None  # why it ended with `error`, when this process decided it (the engine gone, a shutdown)


@dataclasses.dataclass(eq=False)
class _Subscriber:
    index: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # receives list[Delta], one list per step


class EngineClient:
    """Submits, aborts and calls from asyncio code on any event loop; thread-safe."""

    def __init__(self, metrics: Metrics | None = None):
        self.metrics = metrics or Metrics()
        self.info: core_process.EngineInfo | None = None
        self.startup: dict = {"phase": "starting"}  # the engine's last start-up progress report
        self.error: str | None = None  # why the core died, if it did
        self._dir = tempfile.mkdtemp(prefix="jaxserve-")
        self._addrs = (f"ipc://{self._dir}/commands", f"ipc://{self._dir}/outputs")
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._outputs = self._context.socket(zmq.PULL)
        for sock, addr in zip((self._commands, self._outputs), self._addrs):
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop nor block: the 429 bound limits the queue
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.bind(addr)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _subs and _pending
        self._subs: dict[str, _Subscriber] = {}
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._keys = itertools.count()
        self._core_alive: Callable[[], bool] = lambda: False
        self._join: Callable[[float], None] = lambda timeout: None
        self._terminate: Callable[[], None] = lambda: None
        self._receiver: threading.Thread | None = None
        self._closing = False
        self._stopping = False  # stop() asked the core to end: its end is no death
        self._factory: Callable[[], Any] | None = None  # what a restart builds again
        self._restarts = 0  # restarts allowed within RESTART_WINDOW_S
        self._replaceable = True  # False: the leader of a multi-host group, whose death ends the server
        self._restart_times: collections.deque[float] = collections.deque()
        self.restarting = False
        self.on_give_up: Callable[[str], None] = lambda why: None  # called (receiver thread) once no restart is left

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
        RESTART_WINDOW_S; at the next death `on_give_up(why)` is called (0: no restart, no giving up).
        Not `replaceable` (one process of a multi-host group): `on_give_up` at the first death."""
        client = cls(metrics)
        client._factory, client._restarts, client._replaceable = factory, restarts, replaceable
        client._launch()
        return client

    def _launch(self) -> None:
        process = multiprocessing.get_context("spawn").Process(
            target=core_process.run_process, name="jaxserve-engine", daemon=True,
            args=(self._factory, *self._addrs, logging.getLogger().getEffectiveLevel(), os.getpid()))
        process.start()
        self._core_alive = process.is_alive
        self._join = process.join
        self._terminate = process.terminate
        self._exit_reason = lambda: f"the engine process exited with code {process.exitcode}"

    def wait_ready(self, timeout: float | None = None) -> None:
        """Waits for the engine started by `start_process`, keeping its progress in `startup`."""
        self._start(timeout, self._exit_reason)

    @classmethod
    def in_thread(cls, engine, metrics: Metrics | None = None) -> "EngineClient":
        """Runs the engine core's loop over `engine` in a thread of this process."""
        client = cls(metrics)

        def run():
            commands, outputs = core_process.connect(client._context, *client._addrs)
            try:
                core_process.serve(engine, commands, outputs)
            finally:
                commands.close(linger=0)
                outputs.close(linger=1000)
        thread = threading.Thread(target=run, name="jaxserve-engine", daemon=True)
        thread.start()
        client._core_alive = thread.is_alive
        client._join = thread.join
        client._start(None, lambda: "the engine thread ended")
        return client

    def _start(self, timeout: float | None, exit_reason: Callable[[], str]) -> None:
        try:
            self._await_ready(timeout, exit_reason)
        except (RuntimeError, TimeoutError):
            self.close()
            raise
        self._exit_reason = exit_reason
        self._receiver = threading.Thread(target=self._receive, name="jaxserve-receiver", daemon=True)
        self._receiver.start()

    def _await_ready(self, timeout: float | None, exit_reason: Callable[[], str]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            while not self._outputs.poll(200):
                if self._closing or self._stopping:
                    raise RuntimeError("the engine did not start: stopped meanwhile")
                if not self._core_alive():
                    raise RuntimeError(f"the engine did not start: {exit_reason()}")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the engine did not start within {timeout} s")
            kind, payload = pickle.loads(self._outputs.recv())
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
        if self._core_alive():
            self._stopping = True
            if self._receiver is None or self.restarting:  # still starting: it reads no command before it is ready
                self._terminate()
            else:
                self._send(("stop",))
            self._join(timeout)
        self.close()

    def close(self) -> None:
        self._closing = True
        if self._receiver is not None and self._receiver is not threading.current_thread():
            self._receiver.join(5)
        self._die(self.error or "the engine was stopped", reason="abort")
        self._commands.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return self.info is not None and self.error is None and not self._closing and self._core_alive()

    # ---- asyncio side ----

    async def submit(self, prompts: Sequence[list[int]], params: Sequence, prefix: str,
                     arrival_time: float | None = None, cache_salt: str | None = None) -> tuple[list[str], asyncio.Queue]:
        """Queues token-id prompts as one payload (all or none); returns their request ids and the
        queue that receives their Deltas, a list per step. Raises ValueError (bad input),
        QueueFullError or EngineDeadError."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        ids = [f"{prefix}-{i}" for i in range(len(prompts))]
        key, future = self._expect(loop)
        with self._lock:
            for index, request_id in enumerate(ids):
                self._subs[request_id] = _Subscriber(index, loop, deltas)
        self._send(("add", key, ids, [list(p) for p in prompts], list(params), arrival_time or time.monotonic(),
                    cache_salt))
        try:
            error = await future
        except BaseException:  # cancelled, or the core died: forget (and abort) whatever was added
            self._forget(ids)
            self.abort(ids)
            raise
        if error is not None:
            self._forget(ids)
            kind, message = error
            raise (ValueError if kind == "invalid" else QueueFullError if kind == "busy" else RuntimeError)(message)
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        return ids, deltas

    def fail_all(self, why: str) -> None:
        """Ends every request in flight with `error` (its stream's error event says `why`) and
        has the engine abort them, which frees their pages; the engine serves on."""
        self.abort(self._end_all(why, "error"))  # ended here first: the engine's `abort` finishes reach nobody

    def abort(self, request_ids: Sequence[str]) -> None:
        """Ends requests with `abort` and frees their pages; unknown or finished ids are ignored.
        Thread-safe and non-blocking."""
        if request_ids and self.alive:
            self._send(("abort", list(request_ids)))

    async def call(self, fn: Callable[..., Any], *args) -> Any:
        """Runs fn(engine, *args) on the engine's loop and returns its result; fn and args must
        pickle (a module-level function)."""
        self._check_alive()
        key, future = self._expect(asyncio.get_running_loop())
        self._send(("call", key, fn, args))
        return await future

    def _expect(self, loop) -> tuple[str, asyncio.Future]:
        key, future = str(next(self._keys)), loop.create_future()
        with self._lock:
            self._pending[key] = (loop, future)
        return key, future

    def _forget(self, ids: list[str]) -> None:
        with self._lock:
            for request_id in ids:
                self._subs.pop(request_id, None)

    def _send(self, command: tuple) -> None:
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._send_lock:
                self._commands.send(data, zmq.NOBLOCK)
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
        while not self._closing:
            try:
                ready = self._outputs.poll(500)
                if ready:
                    message = pickle.loads(self._outputs.recv())
            except zmq.ZMQError:
                return
            if not ready:
                if not self._core_alive():
                    if not self._stopping:
                        self._die(self._exit_reason())
                        if self._restart():
                            continue
                    return
                continue
            if message[0] == "batch":
                self._on_batch(*message[1:])
            elif message[0] == "dead":
                self._die(message[1])
                if not self._restart():
                    return

    def _restart(self) -> bool:
        """Replaces the dead engine process if a restart is left in the window; True once the new
        one is ready. Requests are refused (503) meanwhile: `alive` is false while `error` is set."""
        while self._factory is not None and not (self._closing or self._stopping):
            if not self._replaceable:  # the group's other processes cannot take a new one in
                log.error("the engine process of the group's leader died: the server stops")
                self.on_give_up(self.error)
                return False
            now = time.monotonic()
            while self._restart_times and now - self._restart_times[0] > RESTART_WINDOW_S:
                self._restart_times.popleft()
            if len(self._restart_times) >= self._restarts:
                if self._restarts:
                    why = (f"the engine process died {len(self._restart_times) + 1} times within "
                           f"{RESTART_WINDOW_S:g} s, past its {self._restarts} restarts ({self.error})")
                    log.error("%s: giving up", why)
                    self.on_give_up(why)
                return False
            self._restart_times.append(now)
            self.metrics.engine_restarts.inc()
            self._join(5)  # the old process must be gone before a new one connects to the sockets
            if self._core_alive():
                self._terminate()
                self._join(5)
            log.warning("starting a new engine process (restart %d of %d within %g s)",
                        len(self._restart_times), self._restarts, RESTART_WINDOW_S)
            self.restarting, self.startup = True, {"phase": "restarting"}
            try:
                self._launch()
                self._await_ready(None, self._exit_reason)
            except RuntimeError as e:
                log.error("%s", e)
                continue
            finally:
                self.restarting = False
            self.metrics.engine_replaced()
            self.error = None
            log.info("the new engine process is ready")
            return True
        return False

    def _on_batch(self, replies: list[tuple], outputs: list[tuple], stats: dict | None) -> None:
        with self._lock:
            answers = [(self._pending.pop(r[1], (None, None)), r) for r in replies]
        for (loop, future), reply in answers:
            if future is not None:
                _safe_call(loop, _resolve, future, reply[2], None if reply[0] == "added" else reply[3])
        if outputs:
            by_loop: dict[asyncio.AbstractEventLoop, dict[asyncio.Queue, list[Delta]]] = {}
            with self._lock:
                for request_id, tokens, logprobs, finish, cached, timings in outputs:
                    self.metrics.generation_tokens.inc(len(tokens))
                    if finish is not None:
                        self.metrics.observe_finished(finish, timings)
                        sub = self._subs.pop(request_id, None)
                    else:
                        sub = self._subs.get(request_id)
                    if sub is not None:  # else its client has gone
                        queues = by_loop.setdefault(sub.loop, {})
                        queues.setdefault(sub.queue, []).append(Delta(sub.index, tokens, logprobs, finish, cached))
            for loop, queues in by_loop.items():
                _safe_call(loop, _deliver, queues)
        if stats is not None:
            self.metrics.observe_engine(stats)

    def _die(self, why: str, reason: str = "error") -> None:
        """The core has ended: records why (unless it was stopped) and ends everything in flight."""
        if self.error is None and reason == "error":
            log.error("the engine died: %s", why)
            self.error = why
        self._end_all(f"the engine stopped ({why})", reason)

    def _end_all(self, why: str, reason: str) -> list[str]:
        """Ends every subscribed request with `reason` and fails every pending command with
        EngineDeadError(why); returns the ids of the requests ended."""
        with self._lock:
            subs, self._subs = self._subs, {}
            pending, self._pending = self._pending, {}
        by_loop: dict = {}
        for sub in subs.values():
            by_loop.setdefault(sub.loop, {}).setdefault(sub.queue, []).append(
                Delta(sub.index, [], None, reason, error=why if reason == "error" else None))
        for loop, queues in by_loop.items():
            _safe_call(loop, _deliver, queues)
        for loop, future in pending.values():
            _safe_call(loop, _resolve, future, None, EngineDeadError(why))
        return list(subs)


def _resolve(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _deliver(queues: dict[asyncio.Queue, list[Delta]]) -> None:
    for q, deltas in queues.items():
        q.put_nowait(deltas)


def _safe_call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed
        pass
