"""A request's own chat template renders in a process of its own, which is killed past its time.

Rendering Jinja is pure Python: in a thread of the API process, a template written to loop holds
the GIL and every stream and `/health` wait behind it (measured: `/health` p99 385 ms, streams'
ITL p99 6x), and the thread cannot be stopped. In a worker process it shares only the CPU, and at
its time limit the worker is killed and replaced. The server's own template (a file, the model's)
is trusted and renders in the API process.

    TemplateSandbox.render(template, variables, timeout) ─► an idle worker (started when first
    needed, WORKERS at most) ─► (template, variables) over a pipe ─► the text, or ValueError (the
    template refused or failed), or TimeoutError (the worker killed)
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import queue
import threading

WORKERS = 2
_MAX_COMPILED = 16  # templates a worker keeps compiled


class TemplateSandbox:
    def __init__(self, workers: int = WORKERS):
        self._context = multiprocessing.get_context("spawn")  # a clean interpreter: no fork of the server's threads
        self._idle: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(workers)
        self.killed = 0  # workers killed past their time limit

    def render(self, template: str, variables: dict, timeout: float) -> str:
        """The template rendered with `variables`, by a worker process, within `timeout` seconds
        (TimeoutError past it: the worker is killed). ValueError when the template fails."""
        with self._slots:
            worker = self._take()
            try:
                worker.conn.send((template, variables))
                if not worker.conn.poll(timeout):
                    self.killed += 1
                    raise TimeoutError(f"the template rendered for over {timeout:g} s")
                ok, value = worker.recv()
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
            return _Worker(self._context)


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, context):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child,), name="jaxserve-template", daemon=True)
        self.process.start()
        child.close()

    def recv(self):
        try:
            return self.conn.recv()
        except EOFError:  # the worker died (out of memory, a crash): the request fails, not the server
            raise ValueError("the chat template's worker process died while rendering") from None

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


def serve(conn) -> None:
    """A worker's loop: (template, variables) in, (True, text) or (False, why) out."""
    env = environment()
    compiled: dict[str, object] = {}
    while True:
        try:
            template, variables = conn.recv()
        except EOFError:
            return  # the server has gone
        try:
            if template not in compiled:
                if len(compiled) >= _MAX_COMPILED:
                    compiled.clear()
                compiled[template] = env.from_string(template)
            conn.send((True, compiled[template].render(**variables)))
        except Exception as e:  # noqa: BLE001 — a template refusing the conversation is the client's error
            conn.send((False, f"the chat template could not render these messages: {e}"))


def environment():
    """A sandboxed Jinja environment that renders chat templates as Hugging Face's
    `apply_chat_template` does, which is how the models' own templates were written and tested:
    blocks trimmed, `break` and `continue`, `raise_exception` and `strftime_now`, and a `tojson`
    that keeps non-ASCII text and `<`, `>`, `&` and `'` as they are (Jinja's own escapes them for
    HTML: a tool described to the model would read differently from the one it was trained on)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = tojson
    return env


def raise_exception(message):
    """Templates call it to refuse a conversation (Hugging Face's convention)."""
    raise ValueError(message)


def strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
