"""Soak test of `jaxserve serve`: a mixed load for --minutes at --concurrency, sampled every minute,
then a verdict.

The mix: streaming and non-streaming, /v1/completions and /v1/chat/completions, greedy and sampled,
n > 1, logprobs, stop strings, a few long shared prefixes with different tails, 10% of streams
closed by the client after 1-3 events, and 5% invalid requests (each must get its 4xx with an
OpenAI error body). Every minute: RSS and open fds of the API process and of the engine process
(/proc), KV pages held (/metrics), p50/p99 end-to-end latency of the requests that ended in that
minute, and requests by outcome.

Verdict (exit 1 if any fails): 0 unexpected failures (a 5xx, a wrong status, an error event, a
missing [DONE], a stop string in the output, a hang...); RSS of each process grows < 5% from minute
5 to the last minute; 0 KV pages held once idle; p99 of the last 5 minutes <= 1.2x that of
minutes 5-10; no engine restart. Runs under 10 minutes compare the same fractions of the run
instead (RSS: the end of the first third; p99: [1/6, 1/3] of the run against its last sixth).

    jaxserve serve --max-slots 32 &        # then
    python scripts/soak.py --url http://127.0.0.1:8000 --minutes 30 --concurrency 32
    python scripts/soak.py --serve "--max-slots 32" --minutes 30 --concurrency 32 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from urllib.parse import urlparse

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_test import percentile  # noqa: E402
from serve_process import (LOOPBACK, ServeProcess, cpu_model, engine_pid, listening_pid, open_fds,  # noqa: E402
                           parse_metrics, rss_mib, wait_idle)

WORDS = ("the quick brown fox jumps over lazy dog a stitch in time saves nine jax compiles python functions to "
         "xla paged attention keeps kv memory tight once upon there was small house near river").split()
STOPS = (["."], [" the", "\n"], ["e"], ["!", "?"])
RSS_GROWTH_MAX = 0.05
P99_RATIO_MAX = 1.2


def invalid_requests(model: str, max_model_len: int) -> list[tuple[str, object, int]]:
    """(path, JSON body or raw bytes, the status it must get)."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
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


@dataclasses.dataclass
class Record:
    kind: str
    outcome: str  # ok, cancelled, invalid (its expected 4xx), rejected (429) or unexpected
    start: float
    end: float
    detail: str = ""

    @property
    def latency(self) -> float:
        return self.end - self.start


class Mix:
    def __init__(self, args, model: str, max_model_len: int, prefixes: list[str]):
        self.args, self.model, self.max_model_len, self.prefixes = args, model, max_model_len, prefixes
        self.invalid = invalid_requests(model, max_model_len)

    def prompt(self, rng: random.Random, prefixed: bool) -> str:
        tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        return f"{rng.choice(self.prefixes)} {tail}" if prefixed else tail

    async def one(self, client: httpx.AsyncClient, rng: random.Random) -> Record:
        a = self.args
        roll = rng.random()
        start = time.monotonic()
        if roll < a.invalid_fraction:
            return await self.send_invalid(client, rng, start)
        cancel = roll < a.invalid_fraction + a.cancel_fraction
        chat, stream = rng.random() < 0.5, cancel or rng.random() < 0.5
        greedy = rng.random() < 0.5
        n = rng.choice((1, 1, 1, 2, 3))
        logprobs, stop = rng.random() < 0.25, rng.choice(STOPS) if rng.random() < 0.25 else None
        prefixed = rng.random() < a.prefix_fraction
        max_tokens = rng.randint(16 if cancel else 1, a.max_tokens)
        body = {"model": self.model, "max_tokens": max_tokens, "n": n, "temperature": 0.0 if greedy else 0.8,
                "seed": rng.randrange(2**31)}
        if chat:
            body["messages"] = [{"role": "user", "content": self.prompt(rng, prefixed)}]
            if logprobs:
                body.update(logprobs=True, top_logprobs=2)
        else:
            body["prompt"] = self.prompt(rng, prefixed)
            if logprobs:
                body["logprobs"] = 2
        if stop:
            body["stop"] = stop
        kind = "/".join(x for x in ("chat" if chat else "completion", "cancel" if cancel else "stream" if stream
                                    else "json", "greedy" if greedy else "sampled", f"n{n}" if n > 1 else "",
                                    "logprobs" if logprobs else "", "stop" if stop else "",
                                    "prefix" if prefixed else "") if x)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            if stream:
                body.update(stream=True, stream_options={"include_usage": True})
                outcome, detail = await self.read_stream(client, path, body, rng.randint(1, 3) if cancel else None)
            else:
                outcome, detail = self.check_json(await client.post(path, json=body), body)
        except (httpx.HTTPError, OSError) as e:
            outcome, detail = "unexpected", f"{type(e).__name__}: {e}"
        except (ValueError, KeyError, TypeError) as e:  # a malformed answer
            outcome, detail = "unexpected", f"malformed answer: {type(e).__name__}: {e}"
        return Record(kind, outcome, start, time.monotonic(), detail)

    async def send_invalid(self, client, rng, start) -> Record:
        path, body, expected = rng.choice(self.invalid)
        kind = f"invalid/{expected}"
        try:
            if isinstance(body, bytes):
                r = await client.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = await client.post(path, json=body)
            if r.status_code != expected:
                return Record(kind, "unexpected", start, time.monotonic(),
                              f"{path} {body!r:.80} got {r.status_code}, not {expected}: {r.text[:200]}")
            error = r.json().get("error")
            if not isinstance(error, dict) or not isinstance(error.get("message"), str):
                return Record(kind, "unexpected", start, time.monotonic(), f"no OpenAI error body: {r.text[:200]}")
            return Record(kind, "invalid", start, time.monotonic())
        except (httpx.HTTPError, OSError, ValueError) as e:
            return Record(kind, "unexpected", start, time.monotonic(), f"{type(e).__name__}: {e}")

    def check_json(self, r: httpx.Response, body: dict) -> tuple[str, str]:
        if r.status_code == 429:
            return "rejected", ""
        if r.status_code != 200:
            return "unexpected", f"status {r.status_code}: {r.text[:200]}"
        out = r.json()
        choices = out["choices"]
        if len(choices) != body["n"]:
            return "unexpected", f"{len(choices)} choices for n={body['n']}"
        chat = "messages" in body
        for ch in choices:
            text = ch["message"]["content"] if chat else ch["text"]
            problem = self.check_choice(body, ch["finish_reason"], text or "",
                                        ch.get("logprobs") is not None)
            if problem:
                return "unexpected", problem
        if out["usage"]["completion_tokens"] > body["n"] * body["max_tokens"]:
            return "unexpected", f"usage {out['usage']} past n * max_tokens"
        return "ok", ""

    def check_choice(self, body: dict, finish_reason, text: str, has_logprobs: bool) -> str:
        if finish_reason not in ("stop", "length"):
            return f"finish_reason {finish_reason!r}"
        for s in body.get("stop") or ():
            if s in text:
                return f"stop string {s!r} in the output {text[-60:]!r}"
        if ("logprobs" in body or "top_logprobs" in body) and not has_logprobs and text:
            return "logprobs asked for, none returned"
        return ""

    async def read_stream(self, client, path: str, body: dict, cancel_after: int | None) -> tuple[str, str]:
        chat = "messages" in body
        texts: dict[int, str] = {}
        reasons: dict[int, str] = {}
        logprobs: dict[int, bool] = {}
        usage, done, events = None, False, 0
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return ("rejected", "") if r.status_code == 429 else \
                    ("unexpected", f"stream status {r.status_code}: {r.text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                if done:
                    return "unexpected", "an event after [DONE]"
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return "unexpected", f"error event: {chunk['error']}"
                usage = chunk.get("usage") or usage
                for ch in chunk.get("choices") or ():
                    i = ch["index"]
                    piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                    texts[i] = texts.get(i, "") + (piece or "")
                    logprobs[i] = logprobs.get(i, False) or ch.get("logprobs") is not None
                    if ch.get("finish_reason"):
                        reasons[i] = ch["finish_reason"]
                events += 1
                if cancel_after is not None and events >= cancel_after:
                    return "cancelled", ""  # leaving the block closes the connection mid-stream
        if not done:
            return "unexpected", "the stream ended without [DONE]"
        if sorted(reasons) != list(range(body["n"])):
            return "unexpected", f"finish reasons {reasons} for n={body['n']}"
        for i in range(body["n"]):
            problem = self.check_choice(body, reasons[i], texts.get(i, ""), logprobs.get(i, False))
            if problem:
                return "unexpected", problem
        if usage is None:
            return "unexpected", "no usage chunk with include_usage"
        return ("cancelled" if cancel_after is not None else "ok"), ""


@dataclasses.dataclass
class Sample:
    t: float  # seconds since the load started
    api_rss: float
    engine_rss: float
    api_fds: float
    engine_fds: float
    pages_used: float
    pages_cached: float
    engine_pid: int | None
    load: float  # the machine's 1-minute load average


async def sample(client: httpx.AsyncClient, api_pid: int, t: float) -> Sample:
    m = parse_metrics((await client.get("/metrics")).text)
    eng = engine_pid(api_pid)
    return Sample(t, rss_mib(api_pid), rss_mib(eng), open_fds(api_pid), open_fds(eng),
                  m.get("jaxserve_kv_pages_used", float("nan")), m.get("jaxserve_kv_pages_cached", float("nan")), eng, os.getloadavg()[0])


def row(records: list[Record], lo: float, hi: float, s: Sample, t0: float, label) -> dict:
    ended = [r for r in records if lo < r.end - t0 <= hi]
    lat = [r.latency for r in ended if r.outcome == "ok"]
    count = {k: sum(r.outcome == k for r in ended) for k in ("ok", "cancelled", "invalid", "rejected", "unexpected")}
    return {"minute": label, "requests": len(ended), **count, "p50_s": percentile(lat, 50),
            "p99_s": percentile(lat, 99), "api_rss_mib": s.api_rss, "engine_rss_mib": s.engine_rss,
            "api_fds": s.api_fds, "engine_fds": s.engine_fds, "kv_pages_used": s.pages_used,
            "kv_pages_cached": s.pages_cached, "load": s.load, "engine_pid": s.engine_pid}


COLUMNS = [("minute", "min"), ("requests", "requests"), ("ok", "ok"), ("cancelled", "cancelled"),
           ("invalid", "4xx as expected"), ("rejected", "429"), ("unexpected", "unexpected"), ("p50_s", "p50 s"),
           ("p99_s", "p99 s"), ("api_rss_mib", "API RSS MiB"), ("engine_rss_mib", "engine RSS MiB"),
           ("api_fds", "API fds"), ("engine_fds", "engine fds"), ("kv_pages_used", "KV pages used"),
           ("kv_pages_cached", "KV pages cached"), ("load", "load avg")]


def table(rows: list[dict]) -> str:
    def cell(key, v):
        if not isinstance(v, float):
            return str(v)
        return "nan" if v != v else f"{v:.3f}" if key.endswith("_s") else f"{v:.1f}" if "rss" in key or key == "load" else f"{v:.0f}"
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(k, r[k]) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def verdict(records: list[Record], samples: list[Sample], duration: float, idle_metrics: dict,
            initial_restarts: float) -> dict:
    checks = []
    unexpected = [r for r in records if r.outcome == "unexpected"]
    checks.append({"check": "unexpected failures", "value": len(unexpected), "target": "0",
                   "pass": not unexpected})
    long_run = duration >= 600
    base_t = 300.0 if long_run else duration / 3
    base = min((s for s in samples if s.t >= base_t - 1), key=lambda s: s.t, default=None)
    last = samples[-1]
    how = "minute 5 -> last minute" if long_run else \
        f"short run: end of the first third (t={base.t / 60 if base else float('nan'):.1f} min) -> last minute"
    for name, attr in (("API process", "api_rss"), ("engine process", "engine_rss")):
        b, e = (getattr(base, attr) if base else float("nan")), getattr(last, attr)
        growth = (e - b) / b if b == b and b > 0 else float("nan")
        checks.append({"check": f"RSS growth, {name} ({how})", "value": f"{b:.1f} -> {e:.1f} MiB ({growth:+.1%})",
                       "target": f"< {RSS_GROWTH_MAX:.0%}", "pass": growth == growth and growth < RSS_GROWTH_MAX})
    pages = idle_metrics.get("jaxserve_kv_pages_used", float("nan"))
    busy = idle_metrics.get("jaxserve_num_requests_running", 0) + idle_metrics.get("jaxserve_num_requests_waiting", 0)
    checks.append({"check": "KV pages held once idle", "value": pages, "target": "0",
                   "pass": pages == 0 and busy == 0,
                   "note": f"{idle_metrics.get('jaxserve_kv_pages_cached', float('nan')):.0f} pages kept by the "
                           f"prefix cache; {busy:.0f} requests running or waiting"})
    (b0, b1), (l0, l1) = ((300, 600), (duration - 300, duration)) if long_run else \
        ((duration / 6, duration / 3), (duration * 5 / 6, duration))
    t0 = min((r.start for r in records), default=0.0)

    def p99(lo, hi):
        lat = [r.latency for r in records if r.outcome == "ok" and lo <= r.end - t0 < hi]
        return percentile(lat, 99), len(lat)
    (pb, nb), (pl, nl) = p99(b0, b1), p99(l0, l1)
    ratio = pl / pb if pb == pb and pb > 0 else float("nan")
    window = "minutes 5-10 vs the last 5" if long_run else \
        f"short run: {b0 / 60:.1f}-{b1 / 60:.1f} min vs {l0 / 60:.1f}-{l1 / 60:.1f} min"
    checks.append({"check": f"p99 latency, {window}", "value": f"{pb:.3f} s ({nb}) -> {pl:.3f} s ({nl}): "
                   f"{ratio:.2f}x", "target": f"<= {P99_RATIO_MAX}x", "pass": ratio == ratio and ratio <= P99_RATIO_MAX})
    restarts = idle_metrics.get("jaxserve_engine_restarts_total", 0) - initial_restarts
    pids = {s.engine_pid for s in samples}
    checks.append({"check": "engine restarts during the run", "value": restarts, "target": "0",
                   "pass": restarts == 0 and len(pids) == 1 and None not in pids})
    return {"pass": all(c["pass"] for c in checks), "checks": checks,
            "unexpected_examples": [f"{r.kind}: {r.detail}" for r in unexpected[:20]]}


async def probe_prefixes(client, model: str, max_model_len: int, prefixes: list[str], max_tokens: int) -> int:
    """The longest prompt of the mix (a prefix, its longest tail, a chat template) must leave room
    for max_tokens; returns the prefixes' prompt tokens."""
    longest = 0
    for p in prefixes:
        r = await client.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": p + " " + " ".join(["house"] * 12)}],
            "max_tokens": 1})
        r.raise_for_status()
        longest = max(longest, r.json()["usage"]["prompt_tokens"])
    if longest + max_tokens > max_model_len:
        raise SystemExit(f"a prompt of the mix takes {longest} tokens: with --max-tokens {max_tokens} that is past the "
                         f"context ({max_model_len}); lower --prefix-words or --max-tokens")
    return longest


async def run(args, url: str, api_pid: int) -> tuple[dict, list[dict]]:
    duration = args.minutes * 60
    timeout = httpx.Timeout(args.request_timeout)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client, \
            httpx.AsyncClient(base_url=url, timeout=30) as side:
        models = (await side.get("/v1/models")).json()["data"][0]
        model, max_model_len = models["id"], models["max_model_len"]
        rng = random.Random(args.seed)
        prefixes = [" ".join(rng.choice(WORDS) for _ in range(args.prefix_words)) for _ in range(args.prefixes)]
        longest = await probe_prefixes(side, model, max_model_len, prefixes, args.max_tokens)
        initial = parse_metrics((await side.get("/metrics")).text)
        print(f"model {model} (context {max_model_len}); {args.prefixes} shared prefixes of {args.prefix_words} "
              f"words (longest prompt {longest} tokens); {args.minutes:g} min at concurrency {args.concurrency}; "
              f"API pid {api_pid}, engine pid {engine_pid(api_pid)}", flush=True)
        mix = Mix(args, model, max_model_len, prefixes)
        records: list[Record] = []
        t0 = time.monotonic()
        samples = [await sample(side, api_pid, 0.0)]
        rows = [row(records, -1, 0, samples[0], t0, 0)]
        print(table(rows), flush=True)
        deadline = t0 + duration

        async def worker():
            while time.monotonic() < deadline:
                records.append(await mix.one(client, random.Random(rng.random())))

        workers = [asyncio.ensure_future(worker()) for _ in range(args.concurrency)]
        minute = 0
        while True:
            minute += 1
            await asyncio.sleep(max(0.0, t0 + minute * 60 - time.monotonic()))
            t = time.monotonic() - t0
            samples.append(await sample(side, api_pid, t))
            rows.append(row(records, (minute - 1) * 60, minute * 60, samples[-1], t0, minute))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            if t >= duration - 1:
                break
        done, hung = await asyncio.wait(workers, timeout=args.drain_timeout)
        for task in hung:
            task.cancel()
        await asyncio.gather(*hung, return_exceptions=True)
        now = time.monotonic()
        records += [Record("hung", "unexpected", now - args.drain_timeout, now,
                           f"still running {args.drain_timeout:.0f} s after the load stopped") for _ in hung]
        idle_metrics, waited = await asyncio.to_thread(wait_idle, url, args.idle_timeout)
        drained = sum(1 for r in records if r.end - t0 > minute * 60)
        if drained:
            last = await sample(side, api_pid, time.monotonic() - t0)
            rows.append(row(records, minute * 60, float("inf"), last, t0, "drain"))
        result = verdict(records, samples, duration, idle_metrics, initial.get("jaxserve_engine_restarts_total", 0))
        result["idle_after_s"] = round(waited, 2)
    return result, rows


def finite(x):
    """JSON has no NaN: None instead."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a jaxserve server already running on loopback")
    target.add_argument("--serve", metavar="ARGS", help="launch `jaxserve serve ARGS` (one string) on a free port")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="with --url: the API process (default: the process listening on the URL's port)")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48, help="each request asks for 1..this many tokens")
    parser.add_argument("--prefixes", type=int, default=3, help="shared prefixes")
    parser.add_argument("--prefix-words", type=int, default=120, help="words in each shared prefix")
    parser.add_argument("--prefix-fraction", type=float, default=0.4, help="requests that start with a shared prefix")
    parser.add_argument("--cancel-fraction", type=float, default=0.10, help="streams the client closes mid-way")
    parser.add_argument("--invalid-fraction", type=float, default=0.05, help="invalid requests (expect a 4xx)")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--drain-timeout", type=float, default=120.0,
                        help="seconds requests in flight may take to end after the load stops before they count as hung")
    parser.add_argument("--idle-timeout", type=float, default=60.0, help="seconds to wait for 0 pages held once idle")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", default=None, help="with --serve: the server's output (default: a temporary file)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the table and the verdict as JSON")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or not 0 < args.concurrency <= 1024:
        parser.error("--minutes must be > 0 and --concurrency in [1, 1024]")

    server = None
    if args.serve is not None:
        log = args.log or tempfile.mkstemp(prefix="soak-serve-", suffix=".log")[1]
        server = ServeProcess(args.serve, log)
        print(f"launched jaxserve serve {args.serve} (pid {server.pid}, log {log})", flush=True)
        print(f"healthy after {server.wait_healthy():.1f} s", flush=True)
        url, api_pid = server.url, server.pid
    else:
        url = args.url.rstrip("/")
        parsed = urlparse(url)
        if parsed.hostname not in LOOPBACK:
            parser.error(f"refusing {url}: the soak reads the server's processes, so it must run on this machine")
        api_pid = args.server_pid or listening_pid(parsed.port or 80)
        if api_pid is None:
            parser.error(f"no process of this user listens on port {parsed.port}: pass --server-pid")
    try:
        result, rows = asyncio.run(run(args, url, api_pid))
    finally:
        if server is not None:
            code = server.close()
            print(f"jaxserve serve exited with {code}")
    cpu = cpu_model()
    print(f"\nCPU: {cpu}\n")
    print(table(rows))
    print("\nverdict:")
    for c in result["checks"]:
        print(f"  {'PASS' if c['pass'] else 'FAIL'}  {c['check']}: {c['value']} (target {c['target']})"
              + (f"; {c['note']}" if c.get("note") else ""))
    for e in result["unexpected_examples"]:
        print(f"    unexpected: {e}")
    print("PASS" if result["pass"] else "FAIL")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(finite({"cpu": cpu, "args": vars(args), "rows": rows, "verdict": result}), f, indent=1)
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
