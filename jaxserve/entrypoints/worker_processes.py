"""Request work that holds the GIL for long runs in a process of its own, killed past its time.

A thread of the API process running Python stops every stream and `/health` while it holds the
GIL, and cannot be stopped: a request's own chat template written to loop (measured: `/health`
p99 385 ms, the streams' ITL p99 6x), or the check of a JSON schema of 500 kB (about 30 ms held
in pieces of 6-11 ms before llguidance's own check). In a worker process it shares only the CPU,
and past its time limit the worker is killed and replaced.

    WorkerProcesses.call(fn, args, timeout) ─► an idle worker (started when first needed,
    `workers` at most; more callers wait) ─► (fn, args) over a pipe ─► fn(*args), or ValueError
    (fn raised: its message), or TimeoutError (the worker killed)

`fn` goes over the pipe by name: a module-level function, returning a picklable value.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import threading


class WorkerProcesses:
    def __init__(self, workers: int, name: str):
        self._context = multiprocessing.get_context("spawn")  # a clean interpreter: no fork of the server's threads
        self._idle: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(workers)
        self.name = name
        self.killed = 0  # workers killed past their time limit

    def call(self, fn, args: tuple, timeout: float, what: str = "the request's work"):
        """fn(*args) in a worker process, within `timeout` seconds (TimeoutError naming `what`
        past it: the worker is killed). ValueError with fn's message when fn raises."""
        with self._slots:
            worker = self._take()
            try:
                worker.conn.send((fn, args))
                if not worker.conn.poll(timeout):
                    self.killed += 1
                    raise TimeoutError(f"{what} ran for over {timeout:g} s")
                ok, value = worker.recv(what)
            except BaseException:
                worker.kill()
                raise
            self._idle.put(worker)
        if not ok:
            raise ValueError(value)
        return value

    def _take(self) -> "_Worker":
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            return _Worker(self._context, self.name)


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, context, name: str):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child,), name=name, daemon=True)
        self.process.start()
        child.close()

    def recv(self, what: str):
        try:
            return self.conn.recv()
        except (EOFError, OSError):  # the worker died (out of memory, a crash): the request fails, not the server
            raise ValueError(f"the worker process died during {what}") from None

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


def serve(conn) -> None:
    """A worker's loop: (fn, args) in, (True, fn(*args)) or (False, its error's message) out."""
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            return  # the server has gone
        try:
            fn, args = pickle.loads(message)
            conn.send((True, fn(*args)))
        except Exception as e:  # noqa: BLE001 — the request's error (its result too, if unpicklable), told to its caller
            conn.send((False, str(e)))
