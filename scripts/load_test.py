"""Load test for a running jaxserve server on loopback.

Sends --requests completions at --concurrency, mixing streaming and non-streaming and cancelling
some streams mid-way, within --time-limit seconds. Prints success / rejection / failure counts,
latency percentiles and throughput, then checks /metrics until the server holds no request and no
KV page. Exits 1 if pages stay held or any request failed unexpectedly (429s are only counted).

    jaxserve serve --model tiny-ckpt &
    python scripts/load_test.py --requests 200 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from urllib.parse import urlparse

import httpx

PROMPTS = ["the quick brown fox", "a stitch in time", "jax compiles python functions", "paged attention keeps",
           "once upon a time", "the capital of france is", "1 2 3 4 5", "hello"]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class Result:
    def __init__(self, kind: str):
        self.kind = kind  # stream, json or cancel
        self.status: int | str | None = None
        self.latency = 0.0
        self.ttft: float | None = None
        self.tokens = 0


async def one(client: httpx.AsyncClient, model: str, rng: random.Random, args) -> Result:
    roll = rng.random()
    kind = "cancel" if roll < args.cancel_fraction else "stream" if roll < args.stream_fraction else "json"
    body = {"model": model, "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(1, args.max_tokens),
            "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randrange(2**31)}
    result = Result(kind)
    start = time.perf_counter()
    try:
        if kind == "json":
            r = await client.post("/v1/completions", json=body)
            result.status = r.status_code
            if r.status_code == 200:
                result.tokens = r.json()["usage"]["completion_tokens"]
        else:
            body.update(stream=True, stream_options={"include_usage": True}, max_tokens=max(body["max_tokens"], 8))
            stop_after = rng.randint(1, 4) if kind == "cancel" else None
            async with client.stream("POST", "/v1/completions", json=body) as r:
                result.status = r.status_code
                if r.status_code != 200:
                    await r.aread()
                    return result
                events = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        result.status = "stream-error"
                        break
                    if chunk["choices"] and result.ttft is None:
                        result.ttft = time.perf_counter() - start
                    if chunk.get("usage"):
                        result.tokens = chunk["usage"]["completion_tokens"]
                    events += 1
                    if stop_after is not None and events >= stop_after:
                        break  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:
        result.status = type(e).__name__
    result.latency = time.perf_counter() - start
    return result


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else float("nan")


async def main(args) -> int:
    if urlparse(args.url).hostname not in LOOPBACK:
        raise SystemExit(f"refusing {args.url}: this load test only targets a server on loopback")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits, timeout=args.time_limit) as client:
        models = (await client.get("/v1/models")).json()
        model = models["data"][0]["id"]
        rng = random.Random(args.seed)
        todo = iter(range(args.requests))
        results: list[Result] = []

        async def worker():
            for _ in todo:
                results.append(await one(client, model, random.Random(rng.random()), args))
        start = time.perf_counter()
        workers = [asyncio.ensure_future(worker()) for _ in range(args.concurrency)]
        done, pending = await asyncio.wait(workers, timeout=args.time_limit)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        elapsed = time.perf_counter() - start

        ok, cancelled, rejected, failed = [], [], [], []
        for r in results:
            (rejected if r.status == 429 else failed if r.status != 200 else cancelled if r.kind == "cancel"
             else ok).append(r)
        latencies = [r.latency for r in ok]
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        tokens = sum(r.tokens for r in ok)
        print(f"requests: {len(results)} of {args.requests} in {elapsed:.1f} s (concurrency {args.concurrency})"
              + (f", {len(pending)} workers stopped at the time limit" if pending else ""))
        print(f"  succeeded {len(ok)}, cancelled mid-stream {len(cancelled)}, rejected (429) {len(rejected)}, "
              f"failed {len(failed)}")
        for r in failed[:5]:
            print(f"    failure: {r.kind} -> {r.status}")
        print(f"  latency p50 {percentile(latencies, 50):.3f} s, p99 {percentile(latencies, 99):.3f} s; "
              f"TTFT (streams) p50 {percentile(ttfts, 50):.3f} s, p99 {percentile(ttfts, 99):.3f} s")
        print(f"  throughput {len(ok) / elapsed:.1f} req/s, {tokens / elapsed:.1f} output tok/s")

        deadline = time.monotonic() + args.drain_timeout
        while True:
            text = (await client.get("/metrics")).text
            used = metric(text, "jaxserve_kv_pages_used")
            busy = metric(text, "jaxserve_num_requests_running") + metric(text, "jaxserve_num_requests_waiting")
            if used == 0 and busy == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        print(f"after the run: {used:.0f} KV pages held, {busy:.0f} requests running or waiting")
        if used != 0 or busy != 0:
            print("FAIL: the server still holds KV pages or requests", file=sys.stderr)
            return 1
        if failed:
            print(f"FAIL: {len(failed)} requests failed", file=sys.stderr)
            return 1
        return 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--stream-fraction", type=float, default=0.5, help="streams, cancelled ones included")
    parser.add_argument("--cancel-fraction", type=float, default=0.1, help="streams closed after 1-4 events")
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds for the whole run")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to wait for pages to free")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 0 < args.requests <= 100_000 or not 0 < args.concurrency <= 1024:
        parser.error("--requests must be in [1, 100000] and --concurrency in [1, 1024]")
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
