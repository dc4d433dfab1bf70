"""Who waits for the engine's outputs in the API process: each request's asyncio queue and each
command's future, each on the event loop of the handler that made it.

    receiver thread ─► deliver(outputs): one list of Deltas per queue, one wake-up per event loop per step
                                         (a request whose output cannot be handed over ends alone with `error`)
                    ─► answer(replies): resolves the futures of `add` and `call` commands
                    ─► end_all(why): the engine is gone, every request and command ends here

The engine's messages are read on the client's receiver thread (engine_client.py); asyncio
objects are touched only on their own loops, through call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
from typing import Sequence

from jaxserve.errors import EngineDeadError
from jaxserve.faults import faults

log = logging.getLogger(__name__)
UNDELIVERED = "the server failed to deliver this request's output"


@dataclasses.dataclass
class Delta:
    """New output of one request in one step; the last one has a finish_reason."""

    index: int  # the request's position in its submit() call
    token_ids: list[int]
    logprobs: list[dict] | None  # {"logprob": float, "top": [(token_id, logprob), ...]} per token
    finish_reason: str | None
    num_cached_tokens: int = 0  # of the request's prompt, served from the prefix cache
    error: str | None = None  # why it ended with `error`, when this process decided it (the engine gone, a shutdown)
    invalid: str | None = None  # why the engine ended it with `error` for its own input (its grammar)


@dataclasses.dataclass(eq=False)
class _Subscriber:
    index: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # receives list[Delta], one list per step


_Batches = dict[asyncio.AbstractEventLoop, dict[asyncio.Queue, list[Delta]]]  # what one step hands each loop


class Subscribers:
    """The requests and commands in flight and where their outputs go; thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()  # guards _requests and _pending
        self._requests: dict[str, _Subscriber] = {}
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._keys = itertools.count()

    def __len__(self) -> int:
        """The requests whose outputs are awaited."""
        return len(self._requests)

    def subscribe(self, request_ids: Sequence[str], loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        """Sends the Deltas of `request_ids` (indexed by their position) to `queue` on `loop`."""
        with self._lock:
            for index, request_id in enumerate(request_ids):
                self._requests[request_id] = _Subscriber(index, loop, queue)

    def forget(self, request_ids: Sequence[str]) -> None:
        with self._lock:
            for request_id in request_ids:
                self._requests.pop(request_id, None)

    def expect(self, loop: asyncio.AbstractEventLoop) -> tuple[str, asyncio.Future]:
        """A key for a command, and the future on `loop` that its reply resolves."""
        key, future = str(next(self._keys)), loop.create_future()
        with self._lock:
            self._pending[key] = (loop, future)
        return key, future

    def answer(self, replies: list[tuple]) -> None:
        """Resolves the futures of the commands the engine replied to in one step: `added` with
        None, else (kind, message) of a refused `add`, or a `call`'s result."""
        with self._lock:
            answers = [(self._pending.pop(r[1], (None, None)), r) for r in replies]
        for (loop, future), reply in answers:
            if future is not None:
                _safe_call(loop, _resolve, future, reply[2], None if reply[0] == "added" else reply[3])

    def deliver(self, outputs: list[tuple]) -> list[str]:
        """Hands one step's outputs, (request id, tokens, logprobs, finish, cached, timings,
        invalid) each, to their queues; a finished request is forgotten. A request whose output raises
        here ends with `error` (logged) and the others are delivered; returns the ids of those
        of them still running in the engine, for it to abort."""
        batches: _Batches = {}
        failed = []
        with self._lock:
            for request_id, tokens, logprobs, finish, cached, _, invalid in outputs:
                try:
                    if faults.armed:
                        faults.check("receive", request_id)
                    sub = self._requests.pop(request_id, None) if finish is not None else \
                        self._requests.get(request_id)
                    if sub is not None:  # else its client has gone
                        _add(batches, sub, Delta(sub.index, tokens, logprobs, finish, cached, invalid=invalid))
                except Exception:  # noqa: BLE001 — this request's output, not the batch: it ends alone
                    log.exception("delivering the output of request %s failed: it ends with error", request_id)
                    sub = self._requests.pop(request_id, None)
                    if sub is not None:
                        _add(batches, sub, Delta(sub.index, [], None, "error", error=UNDELIVERED))
                    if finish is None:
                        failed.append(request_id)
        _send(batches)
        return failed

    def end_all(self, why: str, reason: str) -> list[str]:
        """Ends every subscribed request with `reason` and fails every pending command with
        EngineDeadError(why); returns the ids of the requests ended."""
        with self._lock:
            requests, self._requests = self._requests, {}
            pending, self._pending = self._pending, {}
        batches: _Batches = {}
        for sub in requests.values():
            _add(batches, sub, Delta(sub.index, [], None, reason, error=why if reason == "error" else None))
        _send(batches)
        for loop, future in pending.values():
            _safe_call(loop, _resolve, future, None, EngineDeadError(why))
        return list(requests)


def _add(batches: _Batches, sub: _Subscriber, delta: Delta) -> None:
    batches.setdefault(sub.loop, {}).setdefault(sub.queue, []).append(delta)


def _send(batches: _Batches) -> None:
    for loop, queues in batches.items():
        _safe_call(loop, _deliver, queues)


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
