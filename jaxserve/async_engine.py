"""The engine loop thread: one thread owns the Engine, asyncio handlers talk to it by messages.

    handler ──submit/abort/call──► command queue ──► loop thread: engine.add_request / abort
                                                      while work: engine.step()
    handler ◄── asyncio.Queue ◄── call_soon_threadsafe ◄── new tokens of each subscribed request

The Engine is single-threaded, so nothing but the loop thread ever touches it. The loop blocks on
the command queue while the engine has nothing to do; while a dynamic batch fills (the last step
ran nothing but requests wait) it waits up to `fill_wait_s` for new commands instead of spinning.
After each step it walks the requests it serves (O(active requests)), sends each one's new token
ids (and logprobs) to its subscriber, and releases finished requests from the engine at once, so
nothing leaks. Text is not decoded here: handlers detokenize on their own side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
from typing import Any, Callable, Sequence

from jaxserve.batching import SamplingParams
from jaxserve.metrics import Metrics

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop thread has stopped; nothing more can be served."""


@dataclasses.dataclass
class Delta:
    """New output of one request since the last delta; the last one has a finish_reason."""

    index: int  # the request's position in its submit() call
    token_ids: list[int]
    logprobs: list[dict] | None  # {"logprob": float, "top": [(token_id, logprob), ...]} per token
    finish_reason: str | None
    prompt_token_ids: list[int] | None = None  # in the first delta only


@dataclasses.dataclass(eq=False)
class _Subscriber:
    index: int
    request: Any  # the engine's Request (read by the loop thread only)
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent: int = 0
    first: bool = True


class AsyncEngine:
    """Runs `engine` in a loop thread; asyncio code submits, streams and aborts requests."""

    def __init__(self, engine, metrics: Metrics | None = None, fill_wait_s: float = 0.001):
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.fill_wait_s = fill_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._subs: dict[str, _Subscriber] = {}  # loop thread only
        self._groups = itertools.count(10**9)  # static batching: one group per payload
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None  # why the loop died, if it did

    # ---- lifecycle ----

    def start(self) -> "AsyncEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Aborts every request and ends the loop thread."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- asyncio side ----

    async def submit(self, prompts: Sequence, params: Sequence[SamplingParams],
                     prefix: str | None = None) -> tuple[list[str], asyncio.Queue]:
        """Queues all prompts as one payload (all or none); returns their request ids and the queue
        that receives their `Delta`s. Raises ValueError (bad input), QueueFullError or EngineDeadError."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        deltas: asyncio.Queue = asyncio.Queue()
        prefix = prefix or f"req-{next(self._ids)}"
        ids = [f"{prefix}-{i}" for i in range(len(prompts))]
        self._commands.put(("add", list(prompts), list(params), ids, loop, deltas, future))
        try:
            await self._wait(future)
        except asyncio.CancelledError:  # the caller went away: abort whatever gets added
            self.abort(ids)
            raise
        return ids, deltas

    def abort(self, request_ids: Sequence[str]) -> None:
        """Ends requests with `abort` and frees their pages; unknown or finished ids are ignored.
        Thread-safe and non-blocking."""
        if request_ids:
            self._commands.put(("abort", list(request_ids)))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Runs fn(engine) on the loop thread and returns its result (stats, tests)."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(("call", fn, loop, future))
        return await self._wait(future)

    async def _wait(self, future: asyncio.Future):
        """Awaits a command's answer; fails if the loop dies before it could answer."""
        while True:
            done, _ = await asyncio.wait({future}, timeout=1.0)
            if done:
                return future.result()
            if not (self._thread and self._thread.is_alive()):
                raise EngineDeadError(f"the engine loop stopped ({self.error!r})")

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError(f"the engine loop is not running ({self.error!r})" if self.error
                                  else "the engine loop is not running")

    # ---- loop thread ----

    def _run(self) -> None:
        engine = self.engine
        fill_wait = False  # the last step ran nothing while requests waited (a batch is filling)
        try:
            while not self._stopping:
                if not engine.has_unfinished():
                    self._drain(block=True)
                elif fill_wait:
                    self._drain(timeout=self.fill_wait_s)
                else:
                    self._drain(timeout=0)
                if self._stopping:
                    break
                if engine.has_unfinished():
                    engine.step()
                    fill_wait = engine.idle and bool(engine.scheduler.waiting)
                    self._publish()
                self.metrics.observe_engine(engine.stats())
        except BaseException as e:  # noqa: BLE001 — report any death, then end the thread
            log.exception("the engine loop died")
            self.error = e
        finally:
            self._shutdown()

    def _drain(self, block: bool = False, timeout: float | None = None) -> None:
        """Handles one command (waiting as asked), then every command already queued."""
        try:
            if block:
                command = self._commands.get()
            elif timeout:
                command = self._commands.get(timeout=timeout)
            else:
                command = self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            self._add(*command[1:])
        elif kind == "abort":
            for request_id in command[1]:
                self._abort(request_id)
        elif kind == "call":
            _, fn, loop, future = command
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # noqa: BLE001 — returned to the caller
                result, error = None, e
            loop.call_soon_threadsafe(_resolve, future, result, error)
        elif kind == "stop":
            self._stopping = True

    def _add(self, prompts, params, ids, loop, deltas, future) -> None:
        engine = self.engine
        group = next(self._groups)
        added = []
        try:
            for prompt, p, request_id in zip(prompts, params, ids):
                engine.add_request(prompt, p, request_id=request_id, group=group)
                added.append(request_id)
        except Exception as e:  # noqa: BLE001 — ValueError, QueueFullError, ...: undo the payload
            for request_id in added:
                engine.abort(request_id)
                engine.release(request_id)
            if len(prompts) > 1 and isinstance(e, ValueError):
                e = ValueError(f"prompt {len(added)}: {e}")
            loop.call_soon_threadsafe(_resolve, future, None, e)
            return
        for index, request_id in enumerate(ids):
            request = engine.request(request_id)
            self._subs[request_id] = _Subscriber(index, request, loop, deltas)
            self.metrics.prompt_tokens.inc(len(request.prompt_token_ids))
        loop.call_soon_threadsafe(_resolve, future, ids, None)

    def _abort(self, request_id: str) -> None:
        sub = self._subs.get(request_id)
        if sub is None:
            return  # finished and released already
        self.engine.abort(request_id)
        self._publish_one(request_id, sub, None)

    def _publish(self) -> None:
        """Sends every subscribed request's new tokens; releases the finished ones."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, sub in list(self._subs.items()):
            r = sub.request
            if len(r.output_token_ids) > sub.sent or r.finished:
                self._publish_one(request_id, sub, batches)
        for loop, items in batches.items():
            _safe_call(loop, _deliver, items)

    def _publish_one(self, request_id: str, sub: _Subscriber, batches: dict | None) -> None:
        r = sub.request
        n = len(r.output_token_ids)
        delta = Delta(sub.index, r.output_token_ids[sub.sent: n],
                      r.logprobs[sub.sent: n] if r.params.logprobs is not None else None,
                      r.finish_reason.value if r.finished else None,
                      list(r.prompt_token_ids) if sub.first else None)
        self.metrics.generation_tokens.inc(n - sub.sent)
        sub.sent, sub.first = n, False
        if r.finished:
            del self._subs[request_id]
            self.metrics.observe_finished(r)
            self.engine.release(request_id)
        if batches is not None:  # delivered after the walk, one wake-up per event loop
            batches.setdefault(sub.loop, []).append((sub.queue, delta))
        else:
            _safe_call(sub.loop, _deliver, [(sub.queue, delta)])

    def _shutdown(self) -> None:
        """Ends every request still served (abort, or error if the loop died) and fails pending calls."""
        reason = "error" if self.error is not None else "abort"
        for request_id, sub in list(self._subs.items()):
            try:
                self.engine.abort(request_id)
                self.engine.release(request_id)
            except Exception:  # noqa: BLE001 — the engine may be what broke
                log.exception("could not abort %s", request_id)
            _safe_call(sub.loop, _deliver, [(sub.queue, Delta(sub.index, [], None, reason))])
        self._subs.clear()
        dead = EngineDeadError(f"the engine loop stopped ({self.error!r})" if self.error else "the engine loop stopped")
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                _safe_call(command[4], _resolve, command[6], None, dead)
            elif command[0] == "call":
                _safe_call(command[2], _resolve, command[3], None, dead)


def _resolve(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _deliver(items: list[tuple[asyncio.Queue, Delta]]) -> None:
    for q, delta in items:
        q.put_nowait(delta)


def _safe_call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed
        pass
