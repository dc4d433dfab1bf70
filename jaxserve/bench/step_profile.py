"""Where an engine step's time goes on the host, and how long the device sits idle.

    with StepProfile(engine) as profile:
        ... engine.step() ...
    profile.host_ms_per_step()   # {"schedule": ..., "build": ..., "dispatch": ..., "collect": ..., ...}
    profile.device_idle_share()  # share of the wall time with no step running on the device

It wraps the engine's parts for the duration of the block (nothing in the engine changes). A
waiter thread blocks on each dispatched step's output and stamps when the device finished it;
steps run in dispatch order, so step i is busy from max(its dispatch, step i-1 done) to its done,
and the rest of the wall time is idle. On CPU the "device" is XLA's threads on the same cores,
so idle time is host work that nothing overlapped.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict

import jaxserve.engine.core as core_module


class StepProfile:
    def __init__(self, engine):
        self.engine = engine
        self.spent: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.dispatched: list[float] = []
        self.done: list[float] = []
        self._waits: queue.Queue = queue.Queue()
        self._patches: list[tuple[object, str, object]] = []

    def _timed(self, owner, name: str, label: str, after=None) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = original(*args, **kwargs)
            self.spent[label] += time.perf_counter() - start
            if after is not None:
                after(result)
            return result
        self._patches.append((owner, name, original))
        setattr(owner, name, wrapper)

    def _on_dispatch(self, in_flight) -> None:
        self.dispatched.append(time.perf_counter())
        self._waits.put(in_flight.outputs[0])

    def _wait_loop(self) -> None:
        while (out := self._waits.get()) is not None:
            out.block_until_ready()
            self.done.append(time.perf_counter())

    def __enter__(self) -> "StepProfile":
        e = self.engine
        self._timed(e.scheduler, "schedule", "schedule")
        self._timed(core_module, "build_step", "build")
        self._timed(e.runner, "dispatch", "dispatch", self._on_dispatch)
        self._timed(e.runner, "collect", "collect")  # waiting for the device, then the copy
        self._timed(e.scheduler, "advance", "advance")
        self._timed(e.scheduler, "commit", "commit")
        self._timed(e.outputs, "apply_stop_strings", "detokenize")
        self._timed(e, "step", "step")
        self._waiter = threading.Thread(target=self._wait_loop, daemon=True)
        self._waiter.start()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._waits.put(None)
        self._waiter.join()
        self.end = time.perf_counter()
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)

    def host_ms_per_step(self) -> dict[str, float]:
        """Mean ms per dispatched step of each part; "host" is the step minus the wait in collect."""
        n = max(1, len(self.dispatched))
        parts = {k: v * 1e3 / n for k, v in self.spent.items() if k != "step"}
        parts["host"] = (self.spent["step"] - self.spent["collect"]) * 1e3 / n
        return parts

    def device_idle_share(self) -> float:
        busy, previous = 0.0, self.start
        for dispatched, done in zip(self.dispatched, self.done):
            begin = max(dispatched, previous)
            busy += max(0.0, done - begin)
            previous = done
        wall = self.end - self.start
        return 1 - busy / wall if wall > 0 else float("nan")
