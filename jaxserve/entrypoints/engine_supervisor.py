"""The engine core's life, as the API process sees it: starts it, tells whether it still runs,
ends it, and replaces a dead engine process.

    start_process(factory) ─► a spawned process runs core_process.run_process over the client's sockets
    start_thread(target)   ─► a thread of this process runs the same loop (tests, stand-in engines)
    the client notices a death ─► restart(why, wait_ready): a new process (its steps load from the
        compile cache) if a restart is left within RESTART_WINDOW_S
        ─► else on_give_up(why), for the server to exit non-zero

The sockets, the handshake and the requests in flight are the client's (engine_client.py); this
class only owns the process (or thread) and the restart policy.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import threading
import time
from typing import Any, Callable

from jaxserve.engine import core_process
from jaxserve.entrypoints.metrics import Metrics

log = logging.getLogger(__name__)

RESTART_WINDOW_S = 600.0  # `restarts` counts the engine's restarts over the last ten minutes


class EngineSupervisor:
    """The process (or thread) that runs the engine core, and its replacement after a death."""

    def __init__(self, addrs: tuple[str, str], metrics: Metrics):
        self.addrs = addrs  # (commands, outputs): where a new engine process connects
        self.metrics = metrics
        self.restarting = False  # a new engine process is starting after a death
        self.stopping = False  # the engine was asked to end: its end is no death, and no restart follows
        self.on_give_up: Callable[[str], None] = lambda why: None  # called once no restart is left
        self._core: multiprocessing.Process | threading.Thread | None = None
        self._factory: Callable[[], Any] | None = None  # what a restart builds again
        self._restarts = 0  # restarts allowed within RESTART_WINDOW_S
        self._replaceable = True  # False: the leader of a multi-host group, whose death ends the server
        self._restart_times: collections.deque[float] = collections.deque()

    def start_process(self, factory: Callable[[], Any], restarts: int = 0, replaceable: bool = True) -> None:
        """Starts the engine core in a new process (spawned, never forked, so jax starts fresh
        there) that builds its engine with `factory()`; see `restart` for `restarts` and `replaceable`."""
        self._factory, self._restarts, self._replaceable = factory, restarts, replaceable
        self._launch()

    def start_thread(self, target: Callable[[], None]) -> None:
        """Runs the engine core's loop, `target()`, in a thread of this process; it is never restarted."""
        self._core = threading.Thread(target=target, name="jaxserve-engine", daemon=True)
        self._core.start()

    def _launch(self) -> None:
        self._core = multiprocessing.get_context("spawn").Process(
            target=core_process.run_process, name="jaxserve-engine", daemon=True,
            args=(self._factory, *self.addrs, logging.getLogger().getEffectiveLevel(), os.getpid()))
        self._core.start()

    def alive(self) -> bool:
        return self._core is not None and self._core.is_alive()

    def exit_reason(self) -> str:
        if isinstance(self._core, threading.Thread):
            return "the engine thread ended"
        return f"the engine process exited with code {self._core.exitcode}"

    def end(self, ask: Callable[[], None] | None, timeout: float) -> None:
        """Ends a running engine with `ask()` (it sends the core a stop command) or, with None
        (the core reads no command while it starts), by terminating its process; then waits up
        to `timeout` seconds for it."""
        if not self.alive():
            return
        self.stopping = True
        if ask is None:
            self._terminate()
        else:
            ask()
        self._core.join(timeout)

    def _terminate(self) -> None:
        if not isinstance(self._core, threading.Thread):  # a thread cannot be ended from outside
            self._core.terminate()

    # ---- after a death ----

    def restart(self, why: str, wait_ready: Callable[[], None]) -> bool:
        """Replaces the engine process that died (`why`) if a restart is left in the window; True
        once `wait_ready()` has returned for the new one. Else calls `on_give_up` (unless no
        restart was ever allowed) and returns False."""
        while self._factory is not None and not self.stopping:
            if not self._may_restart(why):
                return False
            self.metrics.engine_restarts.inc()
            self._reap()
            log.warning("starting a new engine process (restart %d of %d within %g s)",
                        len(self._restart_times), self._restarts, RESTART_WINDOW_S)
            self.restarting = True
            try:
                self._launch()
                wait_ready()
            except RuntimeError as e:
                log.error("%s", e)
                continue
            finally:
                self.restarting = False
            self.metrics.engine_replaced()
            log.info("the new engine process is ready")
            return True
        return False

    def _may_restart(self, why: str) -> bool:
        """Counts a restart if one is left within RESTART_WINDOW_S; else gives up."""
        if not self._replaceable:  # the group's other processes cannot take a new one in
            log.error("the engine process of the group's leader died: the server stops")
            self.on_give_up(why)
            return False
        now = time.monotonic()
        while self._restart_times and now - self._restart_times[0] > RESTART_WINDOW_S:
            self._restart_times.popleft()
        if len(self._restart_times) >= self._restarts:
            if self._restarts:
                why = (f"the engine process died {len(self._restart_times) + 1} times within "
                       f"{RESTART_WINDOW_S:g} s, past its {self._restarts} restarts ({why})")
                log.error("%s: giving up", why)
                self.on_give_up(why)
            return False
        self._restart_times.append(now)
        return True

    def _reap(self) -> None:
        """The old process must be gone before a new one connects to the sockets."""
        self._core.join(5)
        if self._core.is_alive():
            self._core.terminate()
            self._core.join(5)
