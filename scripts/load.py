"""Load for `jaxserve serve` on loopback, in four modes (below; `load.py MODE --help` tells each
one's figures and targets, docs/serving.md, faults.md and scale-out.md have results). `load` and
`soak` drive a running server (--url) or start one (--serve "ARGS"); `kill` and `replicas` start
their own: `jaxserve serve ARGS` on a free loopback port, stopped with SIGTERM.

    python scripts/load.py load --url http://127.0.0.1:8000 --requests 200 --concurrency 32
    python scripts/load.py soak --serve "--max-slots 32" --minutes 30 --concurrency 32 --json soak.json
    python scripts/load.py kill --serve "--model /tmp/tiny-llama --max-model-len 512" --kill-tokens 400
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import inspect
import itertools
import json
import math
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlparse

import httpx

from jaxserve.bench.http_load import Call, metrics, percentile, probe, run_pool, send, settle, start_all, wait_idle
from jaxserve.bench.server_process import (LOOPBACK, ServeProcess, cpu_model, cpu_seconds, engine_pids,
                                           listening_pid, open_fds, rss_mib)

PROGRAMS = re.compile(r"(\d+) step programs ready in ([\d.]+) s: (\d+) compiled, (\d+) loaded from the compile cache")
REPLICA_HEADER = "x-jaxserve-replica"  # as jaxserve/ray_serve.py sets it (that module imports ray)


# ---- shared by the modes ----

@contextlib.contextmanager
def launched(args, name: str, *more: str):
    """`jaxserve serve` with --serve's options and `more`, healthy, until the block ends."""
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="jaxserve-load-")
    log = os.path.join(args.log_dir, f"{name}.log")
    server = ServeProcess([*shlex.split(args.serve or ""), *more], log)
    print(f"[{name}] {shlex.join(['jaxserve', *server.command[1:]])} (pid {server.pid}, log {log})", flush=True)
    try:
        took = server.wait_healthy(args.start_timeout)
        found = PROGRAMS.findall(server.output())[:1]
        print(f"[{name}] healthy after {took:.1f} s" + "".join(f"; {n} step programs in {s} s: {c} compiled, {k} "
                                                             "loaded" for n, s, c, k in found), flush=True)
        yield server
    finally:
        print(f"[{name}] jaxserve serve exited with {server.close()}", flush=True)


@contextlib.contextmanager
def target(args, name: str):
    """(URL, API process id or None) of the server to load: one started with --serve, else --url
    (on loopback) with --server-pid."""
    if args.serve is not None:
        with launched(args, name) as server:
            yield server.url, server.pid
        return
    if urlparse(args.url).hostname not in LOOPBACK:
        raise SystemExit(f"refusing {args.url}: this tool only loads a server on loopback")
    yield args.url.rstrip("/"), getattr(args, "server_pid", None)


def client(url: str, args, connections: int, timeout: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout)


async def served_model(c: httpx.AsyncClient) -> dict:
    return (await c.get("/v1/models")).json()["data"][0]


def figures(rows: list[tuple]) -> bool:
    """Prints (figure, value[, target, whether it is met]) rows as a table; True if none missed its target."""
    print("| figure | value | target | pass |\n|---|---|---|---|")
    for name, value, *met in rows:
        print(f"| {name} | {value} | {met[0] if met else ''} | {('PASS' if met[1] else 'FAIL') if met else ''} |")
    passed = all(met[1] for _, _, *met in rows if met)
    print("PASS" if passed else "FAIL")
    return passed


def finite(x):
    """JSON has no NaN: None instead."""
    if isinstance(x, (list, tuple, dict)):
        return {k: finite(v) for k, v in x.items()} if isinstance(x, dict) else [finite(v) for v in x]
    return None if isinstance(x, float) and x != x else x


def save(args, result: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(finite({"cpu": cpu_model(), "args": vars(args), **result}), f, indent=1, default=str)


# ---- load ----

PROMPTS = ["the quick brown fox", "a stitch in time", "jax compiles python functions", "paged attention keeps",
           "once upon a time", "the capital of france is", "1 2 3 4 5", "hello"]


def load_calls(args, model: str):
    rng = random.Random(args.seed)
    for _ in range(args.requests):
        r = random.Random(rng.random())
        roll = r.random()
        kind = "cancel" if roll < args.cancel_fraction else "stream" if roll < args.stream_fraction else "json"
        body = {"model": model, "prompt": r.choice(PROMPTS), "max_tokens": r.randint(1, args.max_tokens),
                "temperature": r.choice([0.0, 0.7, 1.0]), "seed": r.randrange(2**31)}
        if kind != "json":
            body.update(stream=True, stream_options={"include_usage": True}, max_tokens=max(body["max_tokens"], 8))
        yield Call("/v1/completions", body, kind, r.randint(1, 4) if kind == "cancel" else None)


def load_outcome(c: Call) -> str:
    if c.status == 429:
        return "rejected"
    return "failed" if c.error or c.status != 200 or c.errors() else "cancelled" if c.kind == "cancel" else "ok"


async def load(args) -> int:
    """A burst of completions: counts, latency, throughput; then no KV page may stay held.

    --requests completions at --concurrency within --time-limit seconds: streaming and not, and
    streams the client closes after 1-4 events. Prints the counts by outcome, latency and TTFT
    percentiles and throughput, then polls /metrics until the server holds no request and no KV
    page. Exit 1 if pages stay held or a request failed (429s are only counted)."""
    with target(args, "load") as (url, _):
        async with client(url, args, args.concurrency, args.time_limit) as c:
            model = (await served_model(c))["id"]
            start = time.monotonic()
            ended, stopped = await run_pool(c, load_calls(args, model), args.concurrency, start + args.time_limit)
            elapsed = time.monotonic() - start
            m, _ = await wait_idle(c, args.drain_timeout)
    by = {k: [r for r in ended if load_outcome(r) == k] for k in ("ok", "cancelled", "rejected", "failed")}
    lat, ttft = [r.latency for r in by["ok"]], [r.ttft for r in by["ok"] if not math.isnan(r.ttft)]
    tokens = sum(r.tokens() for r in by["ok"])
    print(f"requests: {len(ended)} of {args.requests} in {elapsed:.1f} s (concurrency {args.concurrency})"
          + (f", {stopped} stopped at the time limit" if stopped else ""))
    print(f"  succeeded {len(by['ok'])}, cancelled mid-stream {len(by['cancelled'])}, rejected (429) "
          f"{len(by['rejected'])}, failed {len(by['failed'])}")
    for r in by["failed"][:5]:
        print(f"    failure: {r.kind} -> {r.ended_as()} {r.error or r.errors() or r.text[:100]}")
    print(f"  latency p50 {percentile(lat, 50):.3f} s, p99 {percentile(lat, 99):.3f} s; "
          f"TTFT (streams) p50 {percentile(ttft, 50):.3f} s, p99 {percentile(ttft, 99):.3f} s")
    print(f"  throughput {len(by['ok']) / elapsed:.1f} req/s, {tokens / elapsed:.1f} output tok/s")
    used = m.get("jaxserve_kv_pages_used", math.nan)
    running = m.get("jaxserve_num_requests_running", math.nan) + m.get("jaxserve_num_requests_waiting", math.nan)
    checks = [("after the run: KV pages held, requests running or waiting", f"{used:.0f}, {running:.0f}", "0, 0",
               used == 0 and running == 0), ("failed requests", len(by["failed"]), "0", not by["failed"])]
    passed = figures(checks)
    save(args, {"counts": {k: len(v) for k, v in by.items()}, "seconds": elapsed, "output_tokens": tokens,
                "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
                "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99), "checks": checks})
    return 0 if passed else 1


# ---- soak ----

WORDS = ("the quick brown fox jumps over lazy dog a stitch in time saves nine jax compiles python functions to "
         "xla paged attention keeps kv memory tight once upon there was small house near river").split()
STOPS = (["."], [" the", "\n"], ["e"], ["!", "?"])
OUTCOMES = ("ok", "cancelled", "invalid", "rejected", "unexpected")
RSS_GROWTH_MAX, P99_RATIO_MAX = 0.05, 1.2
PREFIX_FRACTION, INVALID_FRACTION = 0.4, 0.05  # of the requests: a shared prefix; invalid (expect a 4xx)
REQUEST_TIMEOUT, IDLE_TIMEOUT = 300.0, 60.0  # seconds: between a request's events; for 0 pages held once idle


def invalid_requests(model: str, max_model_len: int) -> list[tuple[str, dict | bytes, int]]:
    """(path, JSON body or raw bytes, the status it must get)."""
    c, ch, msgs = "/v1/completions", "/v1/chat/completions", [{"role": "user", "content": "hi"}]
    return [
        (c, {"model": model, "prompt": "hi", "max_tokens": -1}, 400),
        (c, {"model": model, "prompt": "hi", "temperature": -0.5}, 400),
        (c, {"model": model, "prompt": "hi", "max_token": 5}, 400),  # no such field
        (c, {"model": "no-such-model", "prompt": "hi"}, 404),
        (c, {"model": model, "prompt": ""}, 400),
        (c, b'{"prompt": "hi", "max_tokens": ', 400),  # malformed JSON
        (c, {"model": model, "prompt": "hi", "n": 0}, 400),
        (c, {"model": model, "prompt": "hi", "max_tokens": max_model_len + 10}, 400),  # past the context
        (ch, {"model": model, "messages": msgs, "top_logprobs": 2}, 400),  # without logprobs=true
        (ch, {"model": model, "messages": msgs, "top_p": 1.5}, 400),
        (ch, {"model": model, "messages": "hi"}, 400),  # wrong type
    ]


def soak_call(rng: random.Random, args, model: str, prefixes: list[str], invalid: list) -> Call:
    """One request of the mix, drawn with `rng`."""
    roll = rng.random()
    if roll < INVALID_FRACTION:
        path, body, expected = rng.choice(invalid)
        return Call(path, body, f"invalid/{expected}")
    cancel = roll < INVALID_FRACTION + args.cancel_fraction
    chat, stream, greedy = rng.random() < 0.5, cancel or rng.random() < 0.5, rng.random() < 0.5
    n = rng.choice((1, 1, 1, 2, 3))
    logprobs, stop = rng.random() < 0.25, rng.choice(STOPS) if rng.random() < 0.25 else None
    prefixed = rng.random() < PREFIX_FRACTION
    tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
    prompt = f"{rng.choice(prefixes)} {tail}" if prefixed else tail
    body = {"model": model, "max_tokens": rng.randint(16 if cancel else 1, args.max_tokens), "n": n,
            "temperature": 0.0 if greedy else 0.8, "seed": rng.randrange(2**31)}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    if logprobs:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    if stop:
        body["stop"] = stop
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    kind = "/".join(x for x in ("chat" if chat else "completion", "cancel" if cancel else "stream" if stream
                                else "json", "greedy" if greedy else "sampled", f"n{n}" if n > 1 else "",
                                "logprobs" if logprobs else "", "stop" if stop else "", "prefix" if prefixed else "")
                    if x)
    return Call("/v1/chat/completions" if chat else "/v1/completions", body, kind,
                rng.randint(1, 3) if cancel else None)


def answer_problem(c: Call) -> str:
    """What is wrong with a 200 answer of the mix, or ''."""
    body = c.body
    if c.streamed and (not c.done or c.after_done or c.usage() is None):
        return "the stream ended without [DONE]" if not c.done else "an event after [DONE]" if c.after_done \
            else "no usage chunk with include_usage"
    choices = c.choices()
    if sorted(choices) != list(range(body["n"])):
        return f"choices {sorted(choices)} for n={body['n']}"
    for ch in choices.values():
        if ch["finish_reason"] not in ("stop", "length"):
            return f"finish_reason {ch['finish_reason']!r}"
        for s in body.get("stop") or ():
            if s in ch["text"]:
                return f"stop string {s!r} in the output {ch['text'][-60:]!r}"
        if ("logprobs" in body or "top_logprobs" in body) and not ch["logprobs"] and ch["text"]:
            return "logprobs asked for, none returned"
    return f"usage {c.usage()} past n * max_tokens" if c.tokens() > body["n"] * body["max_tokens"] else ""


def soak_outcome(c: Call) -> tuple[str, str]:
    """(one of OUTCOMES, what was unexpected)."""
    if c.kind.startswith("invalid/"):
        expected = int(c.kind.split("/")[1])
        error = c.answer.get("error") if isinstance(c.answer, dict) else None
        if c.status != expected:
            return "unexpected", f"{c.path} {c.body!r:.80} got {c.status or c.error}, not {expected}: {c.text[:200]}"
        if not isinstance(error, dict) or not isinstance(error.get("message"), str):
            return "unexpected", f"no OpenAI error body: {c.text[:200]}"
        return "invalid", ""
    if c.status == 429:
        return "rejected", ""
    if c.error or c.status != 200 or c.errors():
        return "unexpected", c.error or (f"error event: {c.errors()[0]}" if c.errors() else
                                         f"status {c.status}: {c.text[:200]}")
    if c.cancelled:
        return "cancelled", ""
    try:
        problem = answer_problem(c)
    except (KeyError, TypeError, ValueError) as e:
        problem = f"malformed answer: {type(e).__name__}: {e}"
    return ("unexpected", problem) if problem else ("ok", "")


def judge(calls: list[Call], lo: float, hi: float, t0: float) -> list[tuple[Call, str, str]]:
    """The calls that ended in (lo, hi] seconds after t0, each with its outcome and detail."""
    return [(c, *soak_outcome(c)) for c in calls if lo < c.end - t0 <= hi]


async def sample(c: httpx.AsyncClient, api_pid: int, t0: float) -> dict:
    """The server's processes and KV pages now."""
    m, eng = await metrics(c), next(iter(engine_pids(api_pid)), None)
    return {"t": time.monotonic() - t0, "api_rss_mib": rss_mib(api_pid), "engine_rss_mib": rss_mib(eng),
            "api_fds": open_fds(api_pid), "engine_fds": open_fds(eng),
            "kv_pages_used": m.get("jaxserve_kv_pages_used", math.nan),
            "kv_pages_cached": m.get("jaxserve_kv_pages_cached", math.nan), "load": os.getloadavg()[0],
            "engine_pid": eng}


def row(label, judged: list[tuple[Call, str, str]], sampled: dict) -> dict:
    """A table row: the requests that ended in a minute, by outcome, and the sample at its end."""
    lat = [c.latency for c, outcome, _ in judged if outcome == "ok"]
    return {"minute": label, "requests": len(judged), **{k: sum(o == k for _, o, _ in judged) for k in OUTCOMES},
            "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99), **sampled}


COLUMNS = ("minute", "requests", *OUTCOMES, "p50_s", "p99_s", "api_rss_mib", "engine_rss_mib", "api_fds",
           "engine_fds", "kv_pages_used", "kv_pages_cached", "load")  # invalid: got the 4xx expected; rejected: 429


def table(rows: list[dict], header: bool = True) -> str:
    def cell(key, v):
        if not isinstance(v, float) or v != v:
            return str(v)
        return f"{v:.3f}" if key.endswith("_s") else f"{v:.1f}" if "rss" in key or key == "load" else f"{v:.0f}"
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)] if header else []
    return "\n".join(lines + ["| " + " | ".join(cell(k, r[k]) for k in COLUMNS) + " |" for r in rows])


def verdict(judged: list[tuple[Call, str, str]], hung: int, samples: list[dict], duration: float, t0: float,
            idle: dict, restarts: float) -> list[tuple]:
    """The soak's checks, as figures. A run under 10 minutes compares fractions of the run instead of minutes:
    RSS from the end of its first third, p99 over [1/6, 1/3] of the run against its last sixth."""
    unexpected = sum(o == "unexpected" for _, o, _ in judged) + hung
    checks = [("unexpected failures", f"{unexpected}" + (f" ({hung} still running after the drain)" if hung else ""),
               "0", unexpected == 0)]
    long_run = duration >= 600
    base = min((s for s in samples if s["t"] >= (300.0 if long_run else duration / 3) - 1), key=lambda s: s["t"],
               default=samples[-1])
    how = "minute 5 -> last minute" if long_run else \
        f"short run: end of the first third (t={base['t'] / 60:.1f} min) -> last minute"
    for name, key in (("API process", "api_rss_mib"), ("engine process", "engine_rss_mib")):
        b, e = base[key], samples[-1][key]
        growth = (e - b) / b if b > 0 else math.nan
        checks.append((f"RSS growth, {name} ({how})", f"{b:.1f} -> {e:.1f} MiB ({growth:+.1%})",
                       f"< {RSS_GROWTH_MAX:.0%}", growth < RSS_GROWTH_MAX))
    pages = idle.get("jaxserve_kv_pages_used", math.nan)
    running = idle.get("jaxserve_num_requests_running", 0) + idle.get("jaxserve_num_requests_waiting", 0)
    checks.append(("KV pages held once idle", f"{pages:.0f} ({idle.get('jaxserve_kv_pages_cached', math.nan):.0f} "
                   f"kept by the prefix cache; {running:.0f} requests running or waiting)", "0",
                   pages == 0 and running == 0))
    (b0, b1), (l0, l1) = ((300, 600), (duration - 300, duration)) if long_run else \
        ((duration / 6, duration / 3), (duration * 5 / 6, duration))

    def p99(lo, hi):
        lat = [c.latency for c, o, _ in judged if o == "ok" and lo <= c.end - t0 < hi]
        return percentile(lat, 99), len(lat)
    (pb, nb), (pl, nl) = p99(b0, b1), p99(l0, l1)
    ratio = pl / pb if pb > 0 else math.nan
    window = "minutes 5-10 vs the last 5" if long_run else \
        f"short run: {b0 / 60:.1f}-{b1 / 60:.1f} min vs {l0 / 60:.1f}-{l1 / 60:.1f} min"
    checks.append((f"p99 latency, {window}", f"{pb:.3f} s ({nb}) -> {pl:.3f} s ({nl}): {ratio:.2f}x",
                   f"<= {P99_RATIO_MAX}x", ratio <= P99_RATIO_MAX))
    pids = {s["engine_pid"] for s in samples}
    checks.append(("engine restarts during the run", f"{restarts:.0f} (engine pids {pids})", "0",
                   restarts == 0 and len(pids) == 1 and None not in pids))
    return checks


async def longest_prompt(c: httpx.AsyncClient, model: str, prefixes: list[str]) -> int:
    """Prompt tokens of the mix's longest prompt: a prefix, its longest tail, a chat template."""
    longest = 0
    for p in prefixes:
        r = await c.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": p + " house" * 12}], "max_tokens": 1})
        longest = max(longest, r.raise_for_status().json()["usage"]["prompt_tokens"])
    return longest


async def soak(args) -> int:
    """A mixed load for --minutes, sampled every minute, then a verdict.

    --concurrency requests at a time: streaming and not, completions and chat, greedy and sampled,
    n of 1-3, logprobs, stop strings, shared prefixes with different tails, streams the client
    closes after 1-3 events, and invalid requests that must get their 4xx with an OpenAI error
    body. Anything else (a 5xx, an error event, a missing [DONE], a stop string in the output, a
    request still running --drain-timeout s after the load...) is unexpected. Every minute a row:
    requests by outcome, p50/p99 latency, RSS and open fds of the API and engine processes, KV pages
    used and cached, load average. Verdict (exit 1 if a check fails): 0 unexpected failures; RSS of
    each process grows < 5% from minute 5 to the last; 0 KV pages held once idle; p99 of the last
    5 minutes <= 1.2x that of minutes 5-10; no engine restart."""
    duration = args.minutes * 60
    with target(args, "soak") as (url, api_pid):
        api_pid = api_pid or listening_pid(urlparse(url).port or 80)
        if api_pid is None:
            raise SystemExit(f"no process of this user listens on {url}: pass --server-pid")
        async with client(url, args, args.concurrency, REQUEST_TIMEOUT) as c, client(url, args, 2, 30) as side:
            model, context = (m := await served_model(side))["id"], m["max_model_len"]
            rng = random.Random(args.seed)
            prefixes = [" ".join(rng.choice(WORDS) for _ in range(args.prefix_words)) for _ in range(args.prefixes)]
            longest = await longest_prompt(side, model, prefixes)
            if longest + args.max_tokens > context:
                raise SystemExit(f"a prompt of the mix takes {longest} tokens: with --max-tokens {args.max_tokens} "
                                 f"that is past the context ({context}); lower --prefix-words or --max-tokens")
            restarts = (await metrics(side)).get("jaxserve_engine_restarts_total", 0)
            print(f"model {model} (context {context}); {args.prefixes} shared prefixes of {args.prefix_words} words "
                  f"(longest prompt {longest} tokens); {args.minutes:g} min at concurrency {args.concurrency}; "
                  f"API pid {api_pid}, engine pids {engine_pids(api_pid)}", flush=True)
            invalid = invalid_requests(model, context)
            calls = (soak_call(random.Random(rng.random()), args, model, prefixes, invalid) for _ in itertools.count())
            ended: list[Call] = []
            t0 = time.monotonic()
            samples = [await sample(side, api_pid, t0)]
            rows = [row(0, [], samples[0])]
            print(table(rows), flush=True)
            pool = asyncio.ensure_future(run_pool(c, calls, args.concurrency, t0 + duration, args.drain_timeout,
                                                  ended))
            for minute in range(1, math.ceil(duration / 60) + 1):
                end = min(minute * 60, duration)
                await asyncio.sleep(max(0.0, t0 + end - time.monotonic()))
                samples.append(await sample(side, api_pid, t0))
                rows.append(row(minute, judge(ended, (minute - 1) * 60, end, t0), samples[-1]))
                print(table(rows[-1:], header=False), flush=True)
            _, hung = await pool
            idle, waited = await wait_idle(side, IDLE_TIMEOUT)
            if any(r.end - t0 > duration for r in ended):
                rows.append(row("drain", judge(ended, duration, math.inf, t0), await sample(side, api_pid, t0)))
    judged = judge(ended, -math.inf, math.inf, t0)
    checks = verdict(judged, hung, samples, duration, t0, idle,
                     idle.get("jaxserve_engine_restarts_total", 0) - restarts)
    examples = [f"{c.kind}: {detail}" for c, o, detail in judged if o == "unexpected"][:20]
    print(f"\nCPU: {cpu_model()}\n\n{table(rows)}\n\nverdict ({len(judged)} requests; idle {waited:.1f} s after):")
    print("".join(f"    unexpected: {e}\n" for e in examples), end="")
    passed = figures(checks)
    save(args, {"rows": rows, "verdict": checks, "pass": passed, "unexpected_examples": examples})
    return 0 if passed else 1


# ---- kill ----

ENDED_S, BACK_S = 2.0, 30.0  # the targets: streams end after a kill, generations again after it
HANG_S = 30.0  # a stream not ended this long after the kill (or the replica's) hangs
STOPPED = re.compile(r"the engine stops with (\d+) KV pages held by sequences")


def streams(n: int, tokens: int) -> list[Call]:
    """`n` streamed completions of `tokens` tokens each (ignore_eos)."""
    return [Call("/v1/completions", {"prompt": f"Write a long story about the number {i}.", "max_tokens": tokens,
                                     "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
            for i in range(n)]


def whole(c: Call, tokens: int) -> bool:
    """A stream that ended with [DONE] after all its tokens (finish_reason length), no error on the way."""
    return c.done and not c.error and not c.errors() and c.tokens() == tokens and \
        [ch["finish_reason"] for ch in c.choices().values()] == ["length"]


async def engine_drill(args) -> list[tuple]:
    """kill -9 the engine process under --streams streams of --kill-tokens: every stream in flight
    ends within 2 s with an error event and [DONE], none hangs; a generation succeeds again within
    30 s (the new engine loads its steps from the compile cache: warm); then 0 KV pages are held
    and jaxserve_engine_restarts_total is 1."""
    with launched(args, "engine") as server:
        async with client(server.url, args, args.streams + 1, 60) as c:
            calls = streams(args.streams, args.kill_tokens)
            tasks = await start_all(c, calls, args.start_timeout)
            early, load_avg, engine = sum(t.done() for t in tasks), os.getloadavg()[0], server.engine_pids()[0]
            os.kill(engine, signal.SIGKILL)
            killed = time.monotonic()
            print(f"[engine] kill -9 {engine} under {args.streams} streams ({early} had already ended)", flush=True)
            back = asyncio.ensure_future(probe(c, {"prompt": "hello", "max_tokens": 4, "ignore_eos": True},
                                               lambda k: k.status == 200 and k.tokens() == 4, args.back_timeout, 0.1))
            hung = await settle(tasks, HANG_S)
            back, answers, _ = await back
            m, _ = await wait_idle(c, 30)
        new_engine, output = server.engine_pids(), server.output()
    last_end = max(call.end for call in calls) - killed
    with_error = sum(bool(call.errors()) and call.done for call in calls)
    restart = PROGRAMS.findall(output.split("starting a new engine process", 1)[-1])[:1] \
        if "starting a new engine process" in output else []
    warm = [compiled for _, _, compiled, _ in restart] == ["0"]
    pages, restarts = m.get("jaxserve_kv_pages_used"), m.get("jaxserve_engine_restarts_total")
    return [("load average (1 min) at the kill", f"{load_avg:.1f}"),
            ("streams in flight at the kill", f"{args.streams - early} of {args.streams}"),
            ("max time from kill -9 to a stream's end", f"{last_end:.3f} s", f"<= {ENDED_S:g} s", last_end <= ENDED_S),
            (f"streams hung (not ended within {HANG_S:g} s)", hung, "0", hung == 0),
            ("streams ended with an error event and [DONE]", f"{with_error} of {args.streams}",
             f"{args.streams - early}", with_error >= args.streams - early),
            ("answers from the kill to the first generation", ", ".join(f"{k} x{v}" for k, v in answers.items())),
            ("restarted engine's step programs", "".join(f"{n} in {s} s: {c} compiled, {k} loaded" for n, s, c, k in
                                                         restart) or "no restart logged", "0 compiled (warm)", warm),
            ("kill -9 to a generation succeeding again", f"{back:.1f} s" if back else "never", f"<= {BACK_S:g} s",
             back is not None and back <= BACK_S),
            ("KV pages held afterwards", pages, "0", pages == 0),
            ("jaxserve_engine_restarts_total", restarts, "1", restarts == 1),
            ("engine pid", f"{engine} -> {new_engine}", "new", bool(new_engine) and engine not in new_engine),
            ("server exit code at the end (SIGTERM)", server.proc.returncode, "0", server.proc.returncode == 0)]


async def sigterm_drill(args) -> list[tuple]:
    """SIGTERM with --streams requests of --drain-tokens in flight and --shutdown-timeout: all of
    them complete; one-token requests sent right after it (one may arrive before the server has
    seen the signal) until one is refused get 503 (or a refused connection once the listener has
    closed: the table says which); the engine stops with 0 KV pages held; the server exits 0."""
    with launched(args, "sigterm", "--shutdown-timeout", f"{args.shutdown_timeout:g}") as server:
        async with client(server.url, args, args.streams + 1, 60) as c:
            calls = streams(args.streams, args.drain_tokens)
            tasks = await start_all(c, calls, args.start_timeout)
            in_flight, load_avg = sum(not t.done() for t in tasks), os.getloadavg()[0]
            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            print(f"[sigterm] SIGTERM with {in_flight} streams in flight", flush=True)
            _, got, refused = await probe(c, {"prompt": "hi", "max_tokens": 1}, lambda k: k.status != 200,
                                          args.shutdown_timeout, 0.05)
            probe_at, in_flight_at_probe = refused.end - signalled, sum(not t.done() for t in tasks)
            await settle(tasks, args.shutdown_timeout + 30)
        try:
            code = await asyncio.to_thread(server.proc.wait, 60)
        except subprocess.TimeoutExpired:
            code = "still running after 60 s"
        exited, stopped = time.monotonic() - signalled, STOPPED.findall(server.output())
    complete = sum(whole(call, args.drain_tokens) for call in calls)
    last_end = max(call.end for call in calls) - signalled
    return [("load average (1 min) at SIGTERM", f"{load_avg:.1f}"),
            ("requests in flight at SIGTERM", f"{in_flight} of {args.streams}", str(args.streams),
             in_flight == args.streams),
            (f"completed ({args.drain_tokens} tokens, finish_reason length, no error)", f"{complete} of {args.streams}",
             str(args.streams), complete == args.streams),
            ("SIGTERM to the last stream's end", f"{last_end:.1f} s", f"<= {args.shutdown_timeout:g} s",
             last_end <= args.shutdown_timeout),
            ("new request during the drain", f"{refused.ended_as()} at +{probe_at:.2f} s ({in_flight_at_probe} "
             f"streams still in flight; {got.get('200', 0)} probes accepted before)", "503 (or connection refused)",
             refused.ended_as().startswith("HTTP 503") or refused.ended_as() == "ConnectError"),
            ("KV pages held when the engine stopped", stopped[-1] if stopped else "not logged", "0",
             stopped[-1:] == ["0"]),
            ("exit code", code, "0", code == 0),
            ("SIGTERM to exit", f"{exited:.1f} s")]


def ray_serve_args(replicas: int, router: str) -> list[str]:
    return ["--replicas", str(replicas), "--router", router, "--ray-actor-options", json.dumps({"num_cpus": 0})]


def replica(c: Call) -> str:
    """The replica that served a request, else how the request ended."""
    return c.headers.get(REPLICA_HEADER) if c.status == 200 else c.ended_as()


async def replica_drill(args) -> list[tuple]:
    """`--replicas 2 --router round-robin` (the streams split over both replicas); `ray.kill` of
    one replica's actor (as in a crash) once each of --streams streams of --kill-tokens has had its
    first event: the killed replica's streams end (an error event and [DONE]), the survivor's finish
    whole, requests after the kill are served by the survivor (or get errors while the proxy learns
    the replica is gone), and Serve starts a new replica within --back-timeout."""
    import ray
    with launched(args, "replica", *ray_serve_args(2, "round-robin")) as server:
        ray.init(address="auto", namespace="serve", log_to_driver=False)
        try:
            async with client(server.url, args, args.streams + 1, 120) as c:
                hello = {"prompt": "hello", "max_tokens": 1}
                ids = {replica(await send(c, Call("/v1/completions", hello))) for _ in range(4)}  # round-robin: both
                if len(ids) != 2:
                    raise RuntimeError(f"2 replicas expected; 4 requests got {ids}")
                actors = {i: ray.get_actor(f"SERVE_REPLICA::jaxserve#engine#{i}", namespace="serve") for i in ids}
                calls = streams(args.streams, args.kill_tokens)
                tasks = await start_all(c, calls, args.start_timeout)
                victim = replica(calls[0])
                ray.kill(actors[victim], no_restart=True)
                print(f"[replica] killed replica {victim}", flush=True)
                killed = time.monotonic()
                replaced, answered, _ = await probe(c, {"prompt": "a stitch in time", "max_tokens": 2},
                                                    lambda k: k.status == 200 and replica(k) not in ids,
                                                    args.back_timeout, 0.5, replica)
                hung = await settle(tasks, HANG_S)
        finally:
            ray.shutdown()  # before the server stops the cluster, which would end this process too
    lost = [call for call in calls if replica(call) == victim]
    kept = [call for call in calls if call not in lost]
    ends = collections.Counter(call.ended_as() for call in lost)
    return [("streams on the killed replica, on the survivor", f"{len(lost)}, {len(kept)}"),
            ("the killed replica's streams: how they ended, the last", f"{dict(ends)}, "
             f"+{max(call.end for call in lost) - killed:.1f} s after the kill", "all ended", hung == 0),
            (f"the survivor's streams finished whole ({args.kill_tokens} tokens)",
             f"{sum(whole(call, args.kill_tokens) for call in kept)} of {len(kept)}", str(len(kept)),
             all(whole(call, args.kill_tokens) for call in kept)),
            ("requests after the kill, by who answered", answered, "not the killed replica", victim not in answered),
            ("kill to a new replica serving", f"{replaced:.1f} s" if replaced else "never",
             f"<= {args.back_timeout:g} s", replaced is not None)]


DRILLS = {"engine": engine_drill, "sigterm": sigterm_drill, "replica": replica_drill}


async def kill(args) -> int:
    """Fault drills, each on a server of its own, then a table of figures with a pass/fail per target.

    Each drill starts `jaxserve serve` with --serve's options (Gemma 3 270M unless --model is among
    them), in --drills' order; exit 1 if any target is missed. The replica drill needs jaxserve[ray]."""
    rows = [(f"{name}: {figure}", *rest) for name in args.drills.split(",")
            for figure, *rest in await DRILLS[name](args)]
    print(f"\nCPU: {cpu_model()}; jaxserve serve {args.serve}\n")
    passed = figures(rows)
    save(args, {"figures": rows, "pass": passed})
    return 0 if passed else 1


# ---- replicas ----

CONFIGS = {"direct": [], "ray-1": ray_serve_args(1, "prefix"), "prefix": ray_serve_args(2, "prefix"),
           "round-robin": ray_serve_args(2, "round-robin"), "pow2": ray_serve_args(2, "pow2")}


def workload(args, seed: int) -> list[list[int]]:
    """--groups groups of --per-group prompts of token ids: the group's own --prefix ids, then
    --suffix of the prompt's own; in one shuffled order."""
    rng = random.Random(seed)
    low, high = args.token_ids
    prompts = []
    for _ in range(args.groups):
        prefix = [rng.randrange(low, high) for _ in range(args.prefix)]
        prompts += [prefix + [rng.randrange(low, high) for _ in range(args.suffix)] for _ in range(args.per_group)]
    rng.shuffle(prompts)
    return prompts


async def replicas_pass(c: httpx.AsyncClient, prompts: list[list[int]], args) -> dict:
    """The prompts, --concurrency at a time: throughput, prefix-cache hit rate, requests per replica."""
    calls = (Call("/v1/completions", {"prompt": p, "max_tokens": args.max_tokens, "temperature": 0,
                                      "ignore_eos": True}) for p in prompts)
    start = time.monotonic()
    ended, stopped = await run_pool(c, calls, args.concurrency, start + args.time_limit)
    elapsed = time.monotonic() - start
    failed = collections.Counter(call.ended_as() for call in ended if call.status != 200 or call.error)
    if failed or stopped:
        raise RuntimeError(f"requests failed: {dict(failed)}; {stopped} stopped at --time-limit")
    usage = [call.usage() for call in ended]
    return {"seconds": elapsed, "requests_per_s": len(ended) / elapsed,
            "output_tok_per_s": sum(u["completion_tokens"] for u in usage) / elapsed,
            "hit_rate": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
            / sum(u["prompt_tokens"] for u in usage),
            "by_replica": dict(collections.Counter(call.headers.get(REPLICA_HEADER, "-") for call in ended))}


async def replicas(args) -> int:
    """Replicas behind Ray Serve (jaxserve/ray_serve.py) against one engine, per configuration.

    The workload: --groups groups of --per-group completions, each group's prompts sharing --prefix
    random token ids and ending with --suffix of their own, --max-tokens each (ignore_eos), in one
    shuffled order, --concurrency at a time, after a warm-up pass of other prefixes. Each
    configuration is a server of its own (--serve here defaults to "--max-slots 16 --max-model-len 1024"):

      direct       one engine, no Ray                    one replica serving everything
      ray-1        --replicas 1 (through Serve's proxy)  throughput vs direct: the Ray overhead
      prefix       --replicas 2 --router prefix          Ray's PrefixCacheAffinityRouter
      round-robin  --replicas 2 --router round-robin
      pow2         --replicas 2 --router pow2            Ray's default router

    Prints per pass: requests/s, output tok/s, the prefix-cache hit rate (cached prompt tokens over
    prompt tokens), requests per replica (x-jaxserve-replica), CPU seconds of the server's engine
    processes and of all its others (under Ray also Ray's own); then the targets' ratios."""
    results: dict[str, list[dict]] = {}
    for name in args.configs.split(","):
        with launched(args, name, *CONFIGS[name]) as server:
            started = time.monotonic() - server.started_at
            async with client(server.url, args, args.concurrency, 600) as c:
                await replicas_pass(c, workload(args, 1000)[: args.concurrency * 2], args)  # warm-up
                for seed in range(args.repeats):
                    before = cpu_seconds(server.pid)
                    run = await replicas_pass(c, workload(args, seed), args)
                    run["cpu_s"] = {k: v - before[k] for k, v in cpu_seconds(server.pid).items()}
                    results.setdefault(name, []).append(run)  # a configuration named twice: both servers' passes
                    print(f"{name:12s} started in {started:5.1f} s: {run['requests_per_s']:6.2f} req/s "
                          f"{run['output_tok_per_s']:7.1f} out tok/s  hit rate {run['hit_rate']:.3f}  "
                          f"({run['seconds']:.1f} s) replicas {sorted(run['by_replica'].values(), reverse=True)}  "
                          f"CPU s: engine {run['cpu_s']['engine']:.1f}, other {run['cpu_s']['other']:.1f}", flush=True)

    def mean(name, key):
        return sum(r[key] for r in results[name]) / len(results[name])
    ratios = {f"hit rate {name} / one engine": mean(name, "hit_rate") / mean("direct", "hit_rate")
              for name in ("prefix", "round-robin", "pow2") if name in results and "direct" in results}
    if "ray-1" in results and "direct" in results:
        ratios["throughput ray-1 / direct"] = mean("ray-1", "output_tok_per_s") / mean("direct", "output_tok_per_s")
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    save(args, {"results": results, "ratios": ratios})
    return 0


# ---- the command line ----

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--serve", metavar="ARGS", help="start `jaxserve serve ARGS` (one string) on a free port")
    common.add_argument("--start-timeout", type=float, default=900.0, help="seconds for a started server to be ready")
    common.add_argument("--log-dir", help="the started servers' output (default: a new temporary folder)")
    common.add_argument("--api-key", help="sent as a bearer token")
    common.add_argument("--json", metavar="PATH", help="also write the results here")
    driving = argparse.ArgumentParser(add_help=False)  # load and soak
    driving.add_argument("--url", default="http://127.0.0.1:8000", help="without --serve: a server on loopback")
    driving.add_argument("--seed", type=int, default=0)
    driving.add_argument("--cancel-fraction", type=float, default=0.1, help="streams the client closes mid-way")

    def mode(run, parents, epilog=None) -> argparse.ArgumentParser:
        p = modes.add_parser(run.__name__, help=run.__doc__.splitlines()[0], description=inspect.cleandoc(run.__doc__),
                             epilog=epilog, parents=parents, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(run=run)
        return p

    p = mode(load, [common, driving])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--stream-fraction", type=float, default=0.5, help="streams, cancelled ones included")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds for the whole run")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to wait for pages to free")
    p = mode(soak, [common, driving])
    p.add_argument("--server-pid", type=int, help="with --url: the API process (default: the one listening there)")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48, help="each request asks for 1..this many tokens")
    p.add_argument("--prefixes", type=int, default=3, help="shared prefixes")
    p.add_argument("--prefix-words", type=int, default=120, help="words in each shared prefix")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="seconds requests in flight may take to end "
                   "after the load stops before they count as hung")
    p = mode(kill, [common], "\n\n".join(f"{k}: {inspect.cleandoc(d.__doc__)}" for k, d in DRILLS.items()))
    p.add_argument("--drills", default="engine,sigterm", help=f"a comma-separated subset of {','.join(DRILLS)}")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--kill-tokens", type=int, default=256, help="tokens per stream in the engine and replica drills")
    p.add_argument("--drain-tokens", type=int, default=64, help="tokens per request in the sigterm drill")
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    p.add_argument("--back-timeout", type=float, default=300.0, help="seconds to wait for a generation (engine "
                   "drill) or a new replica (replica drill) after the kill")
    p = mode(replicas, [common])
    p.add_argument("--configs", default="direct,ray-1,prefix,round-robin,pow2", help=", ".join(CONFIGS))
    for flag, default in (("--groups", 8), ("--per-group", 8), ("--prefix", 512), ("--suffix", 16),
                          ("--max-tokens", 16), ("--concurrency", 8)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--repeats", type=int, default=1, help="measured passes per server (new prefixes each)")
    p.add_argument("--token-ids", type=lambda s: tuple(map(int, s.split(":"))), default=(1000, 200_000),
                   metavar="LOW:HIGH", help="prompt token ids are drawn from [LOW, HIGH) (a tiny test model: 10:150)")
    p.add_argument("--time-limit", type=float, default=900.0, help="seconds for one pass")
    args = parser.parse_args(argv)
    if args.mode == "kill":
        args.serve = args.serve or ""
    if args.mode == "replicas" and args.serve is None:
        args.serve = "--max-slots 16 --max-model-len 1024"
    bounds = {"concurrency": 1024, "streams": 1024, "requests": 100_000, "minutes": 24 * 60}
    for name, most in bounds.items():
        if not 0 < getattr(args, name, 1) <= most:
            parser.error(f"--{name} must be in (0, {most}]")
    for name, known in (("drills", DRILLS), ("configs", CONFIGS)):
        chosen = getattr(args, name, None)
        if chosen is not None and not set(chosen.split(",")) <= set(known):
            parser.error(f"--{name} takes a comma-separated subset of {', '.join(known)}")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    sys.exit(asyncio.run(arguments.run(arguments)))
