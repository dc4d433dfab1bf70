"""The engine core: the one loop that owns an Engine, in a process of its own (or a thread, in tests).

    API process ──commands (PUSH)──► core: drain every queued command: add / abort / call / stop
                                      ──► one message of replies (payload accepted or refused, call results)
                                      ──► engine.step()
                ◄──outputs (PUSH)──── one message per step: each request's new token ids (and
                                      logprobs), its prompt tokens found in the prefix cache, its
                                      finish reason and timings once done; engine stats

The core does nothing but schedule and step: prompts arrive as token ids, and token ids go back;
text is encoded and decoded in the API process, so neither HTTP handling nor the text of the
replies takes the engine's time or its GIL. Only requests with stop strings are detokenized here
too, so that they end at the step their text holds one (`OutputProcessor`, the same code the API
process cuts the text with). Messages are pickled tuples over ZMQ sockets on local IPC paths;
one message per step keeps the per-token cost out of the channel. Finished requests are released
from the engine as soon as their last output is sent, so nothing is kept. `call` runs any picklable
`fn(engine, *args)` on the loop and sends its result back: stats, tests, and the JSON snapshot
of the engine's state for the dashboard (engine_state.py).

Why pickle, when vLLM V1 moved to msgpack, which cannot run code on load: the sockets live in a
directory only this user can enter (mkdtemp, 0700), so whoever can send here can already run code
as this user; `call` carries functions by design, and the start-up info carries the tokenizer and
the config as objects. msgpack would be faster but not by a share of a step that matters:
`scripts/bench_ipc.py` (at 9a6e7d8) measured a step's outputs for 32 requests at 35 µs pickled against 20 µs
(msgspec), an add of 16 prompts of 256 tokens at 358 against 235 µs; a decode step of Gemma 3 270M
takes 80 ms or more on a 2-core CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import time
from typing import Any, Callable

import zmq

log = logging.getLogger(__name__)

_FILL_WAIT_S = 0.001  # a dynamic batch is filling: wait this long for commands instead of spinning
# Requests just finished and nobody waits for their slots: before planning the next step, wait a
# moment (their clients' round trip) for their clients' next requests (a closed loop,
# a chat's next turn), so that they join that step instead of the one after. With async scheduling
# the device is busy meanwhile with the step already dispatched, so a wait shorter than that step
# costs nothing; with steps in order the device idles, so the wait is a smaller share of a step.
_REFILL_WAIT_S = 0.05
_REFILL_SHARE_ASYNC = 0.5  # of the last step's time, with async scheduling
_REFILL_SHARE_IN_ORDER = 0.2  # ... and with steps in order


@dataclasses.dataclass(frozen=True)
class EngineFactory:
    """What the engine process builds: `Engine.from_pretrained(model, config)`, with every step
    shape compiled before it reports ready if `warmup` (so no request waits for a compile; later
    starts load them from the compile cache). Picklable, so the engine is built in the new
    process rather than forked from one that already started jax."""

    model: str | None = None
    config: Any = None  # EngineConfig
    warmup: bool = False
    group: Any = None  # multihost.Group: this engine is the leader (process 0) of a multi-host group

    def __call__(self, progress: Callable[[dict], None] = lambda state: None,
                 built: Callable[[Any], None] = lambda engine: None, fatal: Callable[[str], None] | None = None):
        """Builds the engine; `progress(state)` hears each phase ("loading", then "compiling" with
        `done` of `total` programs), and `built(engine)` is called between the two. In a group,
        `fatal(why)` ends the process when the group cannot go on (from any thread)."""
        if self.group is None:
            return self.build(progress, built)
        from jaxserve.distributed import multihost
        progress({"phase": f"joining a group of {self.group.num_processes} processes"})
        engine, _ = multihost.start(self.group, lambda: self.build(progress, built), fatal or _exit)
        return engine

    def build(self, progress: Callable[[dict], None] = lambda state: None,
              built: Callable[[Any], None] = lambda engine: None):
        """The engine alone (in a group, every process builds it the same way)."""
        from jaxserve.engine.llm_engine import Engine
        progress({"phase": "loading"})
        engine = Engine.from_pretrained(self.model, self.config)
        log.info("resolved:\n%s", engine.describe())
        built(engine)
        if self.warmup:
            start = time.perf_counter()
            total = len(engine.runner.all_programs())
            progress({"phase": "compiling", "done": 0, "total": total})
            programs = engine.runner.warmup(lambda done, total: progress(
                {"phase": "compiling", "done": done, "total": total}))
            cache = engine.runner.cache
            loaded = cache.loaded if cache is not None else 0
            log.info("%d step programs ready in %.1f s: %d compiled, %d loaded from the compile cache", programs,
                     time.perf_counter() - start, programs - loaded, loaded)
            # After the warm-up, not beside it: building llguidance's view of a large vocabulary
            # beside the programs' loads made a warm start's loads about 3x slower (docs/startup.md).
            # It runs in the background: a constrained request in the first seconds waits for it.
            engine.prepare_structured_output()
        return engine


def _exit(why: str) -> None:
    log.critical("%s", why)
    os._exit(1)


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the API process needs to know about the engine, sent once at start-up."""

    model_name: str
    max_model_len: int
    tokenizer: Any  # jaxserve.tokenizer.Tokenizer (pickles as its file's path, or its JSON) or None
    chat_template_source: str | None  # "model", "builtin:gemma3" or None (no template)
    config: Any  # EngineConfig
    vocab_size: int | None = None  # of the model: token ids must be below it


def engine_info(engine) -> EngineInfo:
    tokenizer = getattr(engine, "tokenizer", None)
    source = getattr(tokenizer, "chat_template_source", None)
    vocab = getattr(getattr(engine, "model_config", None), "vocab_size", None)
    return EngineInfo(getattr(engine, "model_name", "model"), engine.max_model_len, tokenizer, source,
                      getattr(engine, "config", None), vocab)


def run_process(factory: Callable[[], Any], commands_addr: str, outputs_addr: str, log_level: int,
                parent_pid: int) -> None:
    """Entry point of the engine process: build the engine, then serve until told to stop (or
    until the API process is gone)."""
    # Ctrl+C signals the whole process group: it is the API process's to handle (it drains, then
    # sends `stop`). SIGTERM keeps ending this process: that is how a starting engine is stopped.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from jaxserve.heap import freeze_startup_objects
    from jaxserve.host_memory import keep_freed_memory
    keep_freed_memory()  # before the ZMQ and XLA threads start, as the engine wants it
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    commands, outputs = connect(context, commands_addr, outputs_addr)
    def progress(state: dict) -> None:
        outputs.send(pickle.dumps(("progress", state)))

    def built(engine) -> None:
        # The engine's description goes out before the warm-up, so the API process reads the
        # tokenizer (seconds for Gemma 3's) while the engine compiles rather than after.
        outputs.send(pickle.dumps(("info", engine_info(engine))))

    def fatal(why: str) -> None:
        # A multi-host group lost a process, maybe while this process's main thread is blocked in a
        # collective that will never end: tell the API process on a socket of this thread's own
        # (a socket belongs to one thread; its own context, whose term() waits until it is sent),
        # then end at once.
        log.critical("%s", why)
        last_context = zmq.Context()
        last = last_context.socket(zmq.PUSH)
        last.connect(outputs_addr)
        last.send(pickle.dumps(("dead", why)))
        last.close(linger=2000)
        last_context.term()
        os._exit(1)
    try:
        engine = factory(progress, built, fatal) if isinstance(factory, EngineFactory) else factory()
    except BaseException as e:  # noqa: BLE001 — reported to the API process, which exits with it
        log.exception("could not build the engine")
        outputs.send(pickle.dumps(("failed", f"{type(e).__name__}: {e}")))
        outputs.close(linger=5000)
        return
    log.info("%d start-up objects frozen out of the garbage collector's passes", freeze_startup_objects())
    try:
        serve(engine, commands, outputs, orphaned=lambda: os.getppid() != parent_pid,
              announced=isinstance(factory, EngineFactory))  # its `built` sent the info
    finally:
        commands.close(linger=0)
        outputs.close(linger=5000)  # let the last message out
        context.term()


def connect(context: zmq.Context, commands_addr: str, outputs_addr: str) -> tuple[zmq.Socket, zmq.Socket]:
    commands = context.socket(zmq.PULL)
    commands.connect(commands_addr)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(outputs_addr)
    return commands, outputs


def serve(engine, commands: zmq.Socket, outputs: zmq.Socket, orphaned: Callable[[], bool] = lambda: False,
          announced: bool = False) -> None:
    """The loop: announce the engine (unless its "info" went out already), then drain commands,
    step and publish until `stop`."""
    core = _Core(engine, outputs, orphaned)
    outputs.send(pickle.dumps(("ready", None if announced else engine_info(engine))))
    try:
        core.loop(commands)
    except BaseException as e:  # noqa: BLE001 — report any death, then end
        log.exception("the engine loop died")
        outputs.send(pickle.dumps(("dead", f"{type(e).__name__}: {e}")))


@dataclasses.dataclass(eq=False)
class _Live:
    request: Any  # the engine's Request
    received: float  # time.monotonic() when this loop took it
    sent: int = 0  # output tokens already published


class _Core:
    def __init__(self, engine, outputs: zmq.Socket, orphaned: Callable[[], bool]):
        self.engine, self.outputs, self.orphaned = engine, outputs, orphaned
        self.live: dict[str, _Live] = {}
        self.stopping = False
        self.groups = 10**9  # one group per payload (static batching)
        overlapped = getattr(getattr(engine, "config", None), "overlaps_steps", False)  # stand-ins lack a config
        self.refill_share = _REFILL_SHARE_ASYNC if overlapped else _REFILL_SHARE_IN_ORDER

    def loop(self, commands: zmq.Socket) -> None:
        engine = self.engine
        fill_wait = False  # the last step ran nothing while requests waited (a batch is filling)
        refill, refill_wait = 0, 0.0  # requests that finished in the last step, with free slots
        last_step = None  # when the last step ended, while steps follow each other
        while not self.stopping:
            busy = engine.has_unfinished()
            if refill:
                commands_now = _receive(commands, refill_wait, want=refill)
            elif busy:
                commands_now = _receive(commands, _FILL_WAIT_S if fill_wait else 0)
            else:  # idle: wait for a command, looking up once a second
                commands_now = _receive(commands, 1.0)
                last_step = None
            refill = 0
            if not busy and not commands_now:
                if self.orphaned():
                    log.warning("the API process is gone: the engine stops")
                    return
                continue
            replies = self.handle(commands_now)
            if replies:
                self._send(("batch", replies, [], None))
            if self.stopping:
                break
            finished = 0
            if engine.has_unfinished():
                finished = len(engine.step())
                fill_wait = engine.idle and engine.stats().get("waiting", 0) > 0
            now = time.perf_counter()
            cycle, last_step = (0.0 if last_step is None else now - last_step), now
            stats = engine.stats()
            self._send(("batch", [], self.collect(), stats))
            refill = 0 if stats.get("waiting", 0) else finished
            refill_wait = min(_REFILL_WAIT_S, self.refill_share * cycle)
        self.abort_all()

    def handle(self, commands: list[tuple]) -> list[tuple]:
        replies = []
        for command in commands:
            kind = command[0]
            if kind == "add":
                replies.append(self.add(*command[1:]))
            elif kind == "abort":
                for request_id in command[1]:
                    if request_id in self.live:
                        self.engine.abort(request_id)
            elif kind == "call":
                _, key, fn, args = command
                try:
                    replies.append(("reply", key, fn(self.engine, *args), None))
                except Exception as e:  # noqa: BLE001 — returned to the caller
                    replies.append(("reply", key, None, _picklable(e)))
            elif kind == "stop":
                self.stopping = True
        return replies

    def add(self, key: str, ids: list[str], prompts: list[list[int]], params: list, arrival: float,
            cache_salt: str | None = None) -> tuple:
        """Adds a payload's prompts as one group, all or none."""
        from jaxserve.errors import QueueFullError
        engine = self.engine
        self.groups += 1
        added = []
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                engine.add_request(prompt, p, request_id=request_id, group=self.groups, arrival_time=arrival,
                                   cache_salt=cache_salt)
                added.append(request_id)
        except Exception as e:  # noqa: BLE001 — ValueError, QueueFullError, ...: undo the payload
            for request_id in added:
                engine.abort(request_id)
                engine.release(request_id)
            kind = "invalid" if isinstance(e, ValueError) else "busy" if isinstance(e, QueueFullError) else "error"
            message = f"prompt {len(added)}: {e}" if len(prompts) > 1 and kind == "invalid" else str(e)
            return ("added", key, (kind, message))
        received = time.monotonic()
        for request_id in ids:
            self.live[request_id] = _Live(engine.request(request_id), received)
        return ("added", key, None)

    def collect(self) -> list[tuple]:
        """(request id, new token ids, their logprobs or None, finish reason or None, prompt tokens
        served from the prefix cache, timings or None, why it ended with error if its own input
        was the cause or None) of every request with news; finished requests are released."""
        out = []
        for request_id, live in list(self.live.items()):
            r = live.request
            n = len(r.output_token_ids)
            if n == live.sent and not r.finished:
                continue
            logprobs = r.logprobs[live.sent: n] if r.params.logprobs is not None else None
            finish = r.finish_reason.value if r.finished else None
            out.append((request_id, r.output_token_ids[live.sent: n], logprobs, finish, r.num_cached_tokens or 0,
                        _timings(r, live.received) if r.finished else None, r.error))
            live.sent = n
            if r.finished:
                del self.live[request_id]
                self.engine.release(request_id)
        return out

    def abort_all(self) -> None:
        """On stop: every request still served ends with `abort`, and the clients hear of it."""
        for request_id in self.live:
            self.engine.abort(request_id)
        stats = self.engine.stats()
        log.info("the engine stops with %d KV pages held by sequences", stats["used_pages"])
        self._send(("batch", [], self.collect(), stats))

    def _send(self, message) -> None:
        self.outputs.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _receive(sock: zmq.Socket, timeout: float, want: int = 1) -> list[tuple]:
    """Every command already queued, after waiting up to `timeout` seconds for `want` of them."""
    deadline = time.monotonic() + timeout
    commands = []
    while True:
        try:
            commands.append(pickle.loads(sock.recv(zmq.NOBLOCK)))
            continue
        except zmq.Again:
            pass
        left = deadline - time.monotonic()
        if len(commands) >= want or left <= 0 or not sock.poll(max(1, int(left * 1000))):
            return commands


def _timings(r, received: float) -> dict[str, float | None]:
    """Seconds from arrival (time.monotonic, the same clock in every process) for the metrics."""
    def since(t):
        return None if t is None else t - r.arrival_time
    first, finish = getattr(r, "first_token_time", None), getattr(r, "finish_time", None)
    n = len(r.output_token_ids)
    return {"handoff": since(received), "queue": since(getattr(r, "admit_time", None)), "ttft": since(first),
            "e2e": since(finish),
            "tpot": (finish - first) / (n - 1) if n > 1 and first is not None and finish is not None else None}


def _picklable(e: Exception) -> Exception:
    try:
        pickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")
