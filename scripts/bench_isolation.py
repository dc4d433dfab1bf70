"""Does one heavy request leave the other streams and /health alone? Two modes, each against a
`jaxserve serve` it starts on a free loopback port:

- `template`: a chat request whose own `chat_template` loops for about --render-s seconds (nested
  `range` loops, calibrated here with jinja2's sandbox), sent to a server started with
  `--trust-request-chat-template` while --streams streams decode. Targets: /health p99 under
  100 ms while the template renders, and the streams' ITL p99 under 2x their p99 without it.
- `schema`: a JSON schema of --properties string properties (optional, or --required), whose
  grammar takes over a second to compile (timed here first with llguidance, on the model's
  tokenizer and on a large one), sent while --streams streams decode. Target: the streams' max ITL
  while it is added stays under 2x their ITL p99 without it.

    python scripts/bench_isolation.py template                  # 8 streams, a 30 s template
    python scripts/bench_isolation.py schema                    # 16 streams, 5000 optional properties
    python scripts/bench_isolation.py schema --required --properties 13000 --model /tmp/tiny-llama
    python scripts/bench_isolation.py schema --required --properties 13000 --positions 4096 --max-tokens 4000
                                                                # streams that never restart in a phase
    git archive HEAD | tar -x -C /tmp/head && PYTHONPATH=/tmp/head python scripts/bench_isolation.py schema
                                                                # a commit's server, whatever the work tree holds

Without --model, a tiny random Llama (2 layers, hidden 64, 512 positions; `build_checkpoint` and
`build_symbols_tokenizer` of tests/conftest.py, run in a subprocess so that the test suite's XLA
flags stay out of the server) is built into a temporary folder. ITL: the gaps between a stream's
successive events that carry a choice. Each mode first runs the streams alone (--baseline-s), then
again with the heavy request sent --lead-s seconds in; the streams are closed loops of
`max_tokens` --max-tokens completions with `ignore_eos`, so they cover the heavy request.

The streams are read here, on the same cores as the server, so two things of this process are kept
out of what it measures: its garbage collector is off (a full pass over the events read so far
stopped the reading for 0.3 s), and the server runs at a lower CPU priority (--server-nice), as if
this process had cores of its own (at equal priority, a second of the server's compile left it
waiting for a core for up to 0.75 s, gaps it then counted as the server's).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import glob
import json
import math
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

from jaxserve.bench.http_load import Call, percentile, send, settle
from jaxserve.bench.server_process import cpu_model
from load import figures, launched  # scripts/load.py, beside this file

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = "the quick brown fox"
INNER = 100_000  # the sandbox's largest range(); the outer loop sets the time


# ---- the streams and /health ----

class Stamped(list):
    """A stream's events, each with its arrival time (time.monotonic()) in `times`."""

    def __init__(self):
        super().__init__()
        self.times: list[float] = []

    def append(self, chunk):
        self.times.append(time.monotonic())
        super().append(chunk)


def stamped_call(path: str, body: dict | bytes, kind: str = "", stream: bool | None = None) -> Call:
    call = Call(path, body, kind, stream=stream)
    call.chunks = Stamped()
    return call


def gaps(calls: list[Call]) -> list[tuple[float, float]]:
    """(when, seconds) of every gap between two successive events with a choice, over all streams."""
    out = []
    for call in calls:
        times = [t for t, c in zip(call.chunks.times, call.chunks) if c.get("choices")]
        out += [(b, b - a) for a, b in zip(times, times[1:])]
    return out


def within(pairs: list[tuple[float, float]], start: float, end: float) -> list[float]:
    return [v for t, v in pairs if start <= t <= end]


def largest(pairs: list[tuple[float, float]], start: float, end: float, n: int) -> list[tuple[float, float]]:
    """The n largest (when, seconds) gaps ending between start and end."""
    return sorted(((t, v) for t, v in pairs if start <= t <= end), key=lambda p: -p[1])[:n]


async def streams(url: str, model: str, args, until: list[float]) -> list[Call]:
    """--streams closed-loop streams until time.monotonic() reaches until[0] (which may move while
    they run; those still running then are cut); every call sent."""
    sent: list[Call] = []
    limits = httpx.Limits(max_connections=args.streams, max_keepalive_connections=args.streams)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as c:
        async def worker():
            while time.monotonic() < until[0]:
                sent.append(stamped_call("/v1/completions", {
                    "model": model, "prompt": PROMPT, "max_tokens": args.max_tokens, "ignore_eos": True,
                    "temperature": 0.0, "stream": True}, "stream"))
                await send(c, sent[-1])

        tasks = [asyncio.ensure_future(worker()) for _ in range(args.streams)]
        while time.monotonic() < until[0] and not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=min(1.0, max(0.0, until[0] - time.monotonic())))
        await settle(tasks, 0)
    return sent


def send_apart(url: str, body: bytes, go, out, done) -> None:
    """In a process of its own: once `go` is set, sends the streamed completion `body` (encoded)
    and puts how it went on `out` (when sent, first token, end: time.monotonic(); how it ended,
    its text, its error messages); then waits for `done` (exiting as the request ends would take
    the cores from the server, running at a lower priority, while the streams are measured)."""
    async def send_it() -> Call:
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            await asyncio.get_running_loop().run_in_executor(None, go.wait)
            return await send(c, stamped_call("/v1/completions", body, stream=True))
    call = asyncio.run(send_it())
    out.put({"start": call.start, "first": call.first, "end": call.end, "ended_as": call.ended_as(),
             "text": "".join(c["choices"][0].get("text") or "" for c in call.chunks if c.get("choices")),
             "errors": [e.get("message", "")[:100] for e in call.errors()]})
    done.wait()


def poll_health(url: str, interval: float, stop, out) -> None:
    """GET /health every `interval` seconds until `stop` is set, in a process of its own (so that
    reading the streams does not delay it); puts [(when sent, seconds, status)] on `out`."""
    samples = []
    with httpx.Client(base_url=url, timeout=30) as c:
        while not stop.is_set():
            start = time.monotonic()
            try:
                status = c.get("/health").status_code
            except httpx.HTTPError:
                status = 0
            samples.append((start, time.monotonic() - start, status))
            time.sleep(max(0.0, interval - (time.monotonic() - start)))
    out.put(samples)


async def phase(url: str, model: str, args, seconds: float, heavy=None):
    """The streams for `seconds` with /health polled; `heavy(client, until)`, if given, runs
    --lead-s in and may move until[0], when the streams stop. Returns (stream calls, health samples)."""
    context = multiprocessing.get_context("fork")
    stop, out = context.Event(), context.Queue()
    poller = context.Process(target=poll_health, args=(url, args.health_interval, stop, out), daemon=True)
    poller.start()
    # The heavy request's client opens before the streams start: opening one loads the CA
    # certificates for TLS (about 30 ms here), a stall of this process the streams would show.
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        until = [time.monotonic() + seconds]
        running = asyncio.ensure_future(streams(url, model, args, until))
        if heavy is not None:
            await asyncio.sleep(args.lead_s)
            await heavy(c, until)
        calls = await running
    stop.set()
    health = await asyncio.get_running_loop().run_in_executor(None, out.get)
    poller.join()
    return calls, health


def itl_rows(name: str, values: list[float]) -> list[tuple]:
    ms = lambda q: f"{1000 * percentile(values, q):.1f} ms"  # noqa: E731
    return [(f"{name}: ITL p50 / p99 / max ({len(values)} gaps)",
             f"{ms(50)} / {ms(99)} / {1000 * max(values, default=math.nan):.1f} ms")]


def health_row(name: str, samples: list[tuple[float, float, int]]) -> tuple:
    lat = [s for _, s, _ in samples]
    bad = sum(1 for *_, status in samples if status != 200)
    return (f"{name}: /health p50 / p99 / max ({len(lat)} polls, {bad} not 200)",
            f"{1000 * percentile(lat, 50):.1f} / {1000 * percentile(lat, 99):.1f} / "
            f"{1000 * max(lat, default=math.nan):.1f} ms")


async def warm(url: str, model: str, extra: dict | None = None) -> None:
    """One short stream and one chat, so that neither phase pays for a first request."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        await send(c, Call("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 8, "stream": True}))
        chat = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": PROMPT}], **(extra or {})}
        await send(c, Call("/v1/chat/completions", chat))


# ---- template ----

def looping_template(outer: int) -> str:
    """Loops outer x INNER times doing nothing, then renders the chat as the tiny models' template does."""
    return (f"{{% for i in range({outer}) %}}{{% for j in range({INNER}) %}}{{% endfor %}}{{% endfor %}}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")


def calibrate(seconds: float) -> tuple[int, float]:
    """The outer count whose template renders in about `seconds` here, in jinja2's sandbox as the
    server renders it; and the seconds the sample took per outer iteration."""
    from jaxserve.entrypoints.template_sandbox import environment
    env = environment()
    sample = 100
    template = env.from_string(looping_template(sample))
    start = time.perf_counter()
    template.render(messages=[{"role": "user", "content": "hi"}])
    per = (time.perf_counter() - start) / sample
    return max(1, round(seconds / per)), per


async def template_mode(args, url: str, model: str, pid: int) -> bool:
    outer, per = calibrate(args.render_s)
    print(f"template: range({outer}) x range({INNER}); {1000 * per:.2f} ms per outer iteration here, so "
          f"about {outer * per:.1f} s to render alone", flush=True)
    await warm(url, model)
    base, base_health = await phase(url, model, args, args.baseline_s)
    heavy_body = {"model": model, "max_tokens": 8, "chat_template": looping_template(outer),
                  "messages": [{"role": "user", "content": PROMPT}]}
    seen = {}

    async def heavy(c, until):
        until[0] = math.inf
        seen["sent"] = time.monotonic()
        seen["call"] = await send(c, Call("/v1/chat/completions", heavy_body))
        until[0] = time.monotonic() + args.tail_s

    calls, health = await phase(url, model, args, args.baseline_s, heavy)
    sent, call = seen["sent"], seen["call"]
    end = call.end  # its render stops then: the worker rendering it is killed at the time limit
    base_itl, load_itl = [v for _, v in gaps(base)], within(gaps(calls), sent, end)
    in_window = [h for h in health if sent <= h[0] <= end]
    p99_base, p99_load = percentile(base_itl, 99), percentile(load_itl, 99)
    p99_health = percentile([s for _, s, _ in in_window], 99)
    rows = [*itl_rows(f"{args.streams} streams alone", base_itl), health_row("streams alone", base_health),
            *itl_rows(f"{args.streams} streams while the template renders", load_itl),
            health_row("while the template renders", in_window),
            ("the template request got", f"{call.ended_as()} after {call.latency:.1f} s: {call.text[:160]!r}"),
            ("ITL p99 while rendering / alone", f"{p99_load / p99_base:.2f}x", "< 2x", p99_load < 2 * p99_base),
            ("/health p99 while rendering", f"{1000 * p99_health:.1f} ms", "< 100 ms", p99_health < 0.100)]
    return figures(rows)


# ---- schema ----

def slow_schema(properties: int, required: bool = False) -> dict:
    """An object of `properties` string properties. Optional ones in a fixed order make a grammar
    that grows with their square (5000: about 1.5 s to build the matcher, 0.6 s to check; but
    llguidance's parser gives up at the first token, its row of items over its limit of 2000).
    Required ones compile in about as long as they are checked (13000: about 1.2 s each) and generate."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}
    return {**schema, "required": list(schema["properties"])} if required else schema


def compile_seconds(schema: dict, folder: str) -> tuple[float, float, float]:
    """(seconds to check the schema without a tokenizer, as the API process does; seconds to build
    the request's matcher, as the engine does on its loop; seconds to build llguidance's tokenizer,
    once per server), with the tokenizer of checkpoint `folder`."""
    from jaxserve.engine.batching.structured_outputs import StructuredOutputs
    from jaxserve.engine.grammars import GrammarMatchers
    from jaxserve.tokenizer import Tokenizer
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config = config.get("model_config", config)  # jaxserve's converted checkpoints nest it
    eos = config.get("eos_token_ids", config.get("eos_token_id"))
    eos = eos if isinstance(eos, list) else [eos]
    matchers = GrammarMatchers(Tokenizer.from_dir(folder), config["vocab_size"], eos)
    start = time.perf_counter()
    matchers._ll_tokenizer  # noqa: B018 — built once per server, not per request: timed apart
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    spec = StructuredOutputs(json=schema)
    checked = time.perf_counter()
    matchers.add("probe", spec)
    return checked - start, time.perf_counter() - checked, tokenizer_s


def large_tokenizer_folder() -> str | None:
    """A converted Gemma 3 270M in jaxserve's cache, if one is there (262k tokens)."""
    cache = os.environ.get("JAXSERVE_CACHE") or os.path.expanduser("~/.cache/jaxserve")
    found = sorted(glob.glob(os.path.join(cache, "gemma-3-270m-*", "tokenizer.json")))
    return os.path.dirname(found[0]) if found else None


async def schema_mode(args, url: str, model: str, pid: int) -> bool:
    schema = slow_schema(args.properties, args.required)
    await warm(url, model, {"response_format": {"type": "json_object"}})
    base, base_health = await phase(url, model, args, args.baseline_s)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "stream": True,
            "structured_outputs": {"json": schema}}
    # Sent from a process of its own, started before the streams: encoding and writing 498 kB
    # here would stall this process's reading of the streams, a gap they would show.
    context = multiprocessing.get_context("fork")
    go, out, done = context.Event(), context.Queue(), context.Event()
    sender = context.Process(target=send_apart, args=(url, json.dumps(body).encode(), go, out, done), daemon=True)
    sender.start()
    seen = {}

    async def heavy(c, until):
        until[0] = math.inf
        go.set()
        seen.update(await asyncio.get_running_loop().run_in_executor(None, out.get))
        until[0] = time.monotonic() + args.tail_s

    calls, health = await phase(url, model, args, args.baseline_s, heavy)
    done.set()
    sender.join()
    sent, first, end = seen["start"], seen["first"], seen["end"]
    window = (sent, (end if math.isnan(first) else first) + 1.0)  # to a second after its first token (or its end)
    base_itl, load_itl = [v for _, v in gaps(base)], within(gaps(calls), *window)
    in_window = [h for h in health if window[0] <= h[0] <= window[1]]
    p99_base, max_load = percentile(base_itl, 99), max(load_itl, default=math.nan)
    base_start = min(c.start for c in base)
    rows = [*itl_rows(f"{args.streams} streams alone", base_itl), health_row("streams alone", base_health),
            ("streams alone, the 5 largest gaps: ms, at s into the phase",
             ", ".join(f"{v * 1e3:.0f} at {t - v - base_start:.2f}" for t, v in largest(gaps(base), -math.inf, math.inf, 5))),
            *itl_rows(f"{args.streams} streams while the schema is added", load_itl),
            health_row("while the schema is added", in_window),
            ("the schema request got", f"{seen['ended_as']} after {end - sent:.2f} s (first token after "
                                       f"{first - sent:.2f} s): {seen['text'][:40]!r} {seen['errors'][:1]}"),
            ("the 5 largest gaps while it is added: ms, at s after sending it",
             ", ".join(f"{v * 1e3:.0f} at {t - v - sent:.2f}" for t, v in largest(gaps(calls), *window, 5))),
            ("max ITL while it is added / p99 alone", f"{max_load / p99_base:.2f}x", "< 2x", max_load < 2 * p99_base)]
    return figures(rows)


def print_compile_times(args, model_folder: str) -> None:
    schema = slow_schema(args.properties, args.required)
    folders = [("the served model's tokenizer", model_folder)]
    large = args.large_tokenizer or large_tokenizer_folder()
    if large:
        folders.append((f"a large tokenizer ({large})", large))
    for name, folder in folders:
        checked, matcher, tokenizer = compile_seconds(schema, folder)
        print(f"schema of {args.properties} {'required' if args.required else 'optional'} properties "
              f"({len(json.dumps(schema)) // 1000} kB), {name}: checked in {checked:.2f} s (API process), "
              f"matcher built in {matcher:.2f} s (engine loop); llguidance's "
              f"tokenizer (once per server) {tokenizer:.2f} s", flush=True)


# ---- main ----

def lower_priority(pid: int, nice: int) -> None:
    """Every thread of process `pid` and of its children at `nice`; and, where the kernel groups
    the processes of a session for its scheduler (autogroup, which makes nice values count only
    within a group), the group of `pid`'s session as well."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass  # no autogroup here: the threads' own nice values count
    process = psutil.Process(pid)
    for p in [process, *process.children(recursive=True)]:
        for thread in p.threads():
            try:
                os.setpriority(os.PRIO_PROCESS, thread.id, nice)
            except OSError:
                pass  # ended meanwhile

def tiny_checkpoint(folder: str, positions: int) -> str:
    """A tiny random Llama of `positions` positions with a tokenizer llguidance can read, built by
    the test suite's helpers."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from conftest import build_checkpoint, "
            "build_symbols_tokenizer; build_symbols_tokenizer(build_checkpoint(sys.argv[2], "
            "max_position_embeddings=int(sys.argv[3])))")
    subprocess.run([sys.executable, "-c", code, os.path.join(HERE, "..", "tests"), folder, str(positions)], check=True)
    return folder


def main(argv=None) -> int:
    args = parse_args(argv)
    model = args.model or tiny_checkpoint(tempfile.mkdtemp(prefix="jaxserve-isolation-"), args.positions)
    print(f"CPU: {cpu_model()}; model {model}", flush=True)
    if args.mode == "schema":
        print_compile_times(args, model)
    flags = ["--trust-request-chat-template"] if args.mode == "template" else []
    with launched(args, args.mode, "--model", model, *flags) as server:
        lower_priority(server.pid, args.server_nice)
        served = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        run = template_mode if args.mode == "template" else schema_mode
        gc.freeze()
        gc.disable()
        passed = asyncio.run(run(args, server.url, served, server.pid))
    return 0 if passed else 1


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["template", "schema"])
    parser.add_argument("--model", help="checkpoint to serve (default: a tiny random Llama built in a temp folder)")
    parser.add_argument("--serve", metavar="ARGS", default="", help="more `jaxserve serve` options, as one string")
    parser.add_argument("--streams", type=int, help="concurrent streams (default: 8 template, 16 schema)")
    parser.add_argument("--max-tokens", type=int, default=400, help="tokens per stream (with ignore_eos)")
    parser.add_argument("--positions", type=int, default=512, help="the tiny model's positions (streams that "
                        "run through a whole phase: --positions 4096 --max-tokens 4000)")
    parser.add_argument("--baseline-s", type=float, default=20.0, help="seconds of streams alone")
    parser.add_argument("--lead-s", type=float, default=3.0, help="seconds of streams before the heavy request")
    parser.add_argument("--tail-s", type=float, default=2.0, help="seconds of streams after it")
    parser.add_argument("--health-interval", type=float, default=0.015, help="seconds between /health polls")
    parser.add_argument("--render-s", type=float, default=30.0, help="template: seconds it should render for")
    parser.add_argument("--properties", type=int, default=5000, help="schema: how many properties")
    parser.add_argument("--required", action="store_true", help="schema: all of them required (try 13000)")
    parser.add_argument("--large-tokenizer", metavar="DIR", help="schema: also time the compile with this "
                        "checkpoint's tokenizer (default: Gemma 3 270M in jaxserve's cache, if there)")
    parser.add_argument("--server-nice", type=int, default=10, help="the server's nice value, above this "
                        "process's 0 (0: the same priority)")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--log-dir", help="the server's output (default: a new temporary folder)")
    args = parser.parse_args(argv)
    args.streams = args.streams or (8 if args.mode == "template" else 16)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    return args


if __name__ == "__main__":
    sys.exit(main())
