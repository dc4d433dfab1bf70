"""A request's own chat template renders in a process of its own, which is killed past its time.

Rendering Jinja is pure Python: in a thread of the API process, a template written to loop holds
the GIL and every stream and `/health` wait behind it, and the thread cannot be stopped. So it
renders in a worker process (`worker_processes`). The server's own template (a file, the
model's) is trusted and renders in the API process.

    TemplateSandbox.render(template, variables, timeout) ─► a worker (WORKERS at most) ─► render
    there ─► the text, or ValueError (the template refused or failed), or TimeoutError (the
    worker killed)
"""

from __future__ import annotations

import datetime
import json

from jaxserve.entrypoints.worker_processes import WorkerProcesses

WORKERS = 2
_MAX_COMPILED = 16  # templates a worker keeps compiled
_compiled: dict[str, object] = {}  # in a worker: template text -> compiled template


class TemplateSandbox:
    def __init__(self, workers: int = WORKERS):
        self._workers = WorkerProcesses(workers, "jaxserve-template")

    @property
    def killed(self) -> int:
        """Workers killed past their time limit."""
        return self._workers.killed

    def render(self, template: str, variables: dict, timeout: float) -> str:
        """The template rendered with `variables`, by a worker process, within `timeout` seconds
        (TimeoutError past it: the worker is killed). ValueError when the template fails."""
        return self._workers.call(render, (template, variables), timeout, what="rendering the chat template")


def render(template: str, variables: dict) -> str:
    """In a worker: the template (compiled once, a few kept) rendered with `variables`."""
    try:
        if template not in _compiled:
            if len(_compiled) >= _MAX_COMPILED:
                _compiled.clear()
            _compiled[template] = environment().from_string(template)
        return _compiled[template].render(**variables)
    except Exception as e:  # noqa: BLE001 — a template refusing the conversation is the client's error
        raise ValueError(f"the chat template could not render these messages: {e}") from None


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
