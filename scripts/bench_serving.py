"""The same closed-loop workload through the Python API and through HTTP, with their ratio.

A closed loop keeps --concurrency requests in flight: each time one finishes, the next starts.
Every request has a --prompt-tokens prompt (random words cut to that many tokens, BOS included)
and generates exactly --output-tokens tokens (ignore_eos; greedy unless --temperature, with
--top-k, --top-p and a seed). Both runs use the same engine options and the same prompts, with
every step shape compiled first (in-process `warmup()`, and `jaxserve serve` does it before it
answers), after a warm-up of --warmup requests each; with --rounds N they alternate N times,
in-process first in odd rounds and HTTP first in even ones (both engines stay loaded), so a
change in the machine's load hits both alike, and the script prints each round's ratios and
their median beside the ratios of the totals. Every round has prompts of its own, so none is a
prefix-cache hit (each phase prints its hit rate):

  in-process: Engine.from_pretrained(...) in this process, add_request / step;
  HTTP:       `jaxserve serve` (API process + engine process) on loopback, streaming completions
              read by an asyncio httpx client here (or a server already running: --url).

TTFT is measured from submission to the first generated token (in-process: seen after a step;
HTTP: the first chunk, which the server sends for the first step that made a token), ITL as (last token - first token) / (tokens - 1), and output
tok/s over the measured phase. The server's own figures (from /metrics) split the HTTP TTFT: from
the request's arrival in the API process to the engine loop taking it (the channel, and the step
it arrived during), to its admission by the scheduler, to its first token's sampling in the
engine, to that token reaching its HTTP handler (the rest of the engine step, the channel), and
the rest outside. The in-process run prints its time from submission to admission. Both print how
many engine steps the phase took, how full they were and how often they ran: the same steps at a
slower pace mean a slower engine (CPU contention), more steps mean worse batching.

    python scripts/bench_serving.py --max-slots 32                       # Gemma 3 270M
    python scripts/bench_serving.py --model tiny-ckpt --mode http --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from jaxserve.bench.http_load import Call, run_pool  # noqa: E402
from jaxserve.bench.server_process import ServeProcess, cpu_model, cpu_seconds  # noqa: E402
from jaxserve.entrypoints.engine_args import add_engine_args, engine_config_from_args  # noqa: E402

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain engine paper window garden music light "
         "stone water market letter story history morning evening city country table system program question "
         "school family student street night money power house side area line result book word").split()


def make_prompts(tokenizer, count: int, num_tokens: int, seed: int) -> list[str]:
    """`count` texts of exactly `num_tokens` tokens each (as the engine encodes them)."""
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < count:
        ids = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(num_tokens * 2)))
        text = tokenizer.decode(ids[:num_tokens])
        if len(tokenizer.encode(text)) == num_tokens:
            prompts.append(text)
    return prompts


def summarize(name: str, ttft: list[float], itl: list[float], tokens: int, elapsed: float) -> dict:
    out = {"mode": name, "ttft": ttft, "itl": itl, "requests": len(ttft), "output_tokens": tokens, "elapsed_s": elapsed,
           "output_tok_s": tokens / elapsed, "ttft_mean_s": statistics.mean(ttft),
           "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": sorted(ttft)[int(0.99 * (len(ttft) - 1))],
           "itl_mean_ms": 1000 * statistics.mean(itl)}
    print(f"{name:>10}: {out['requests']} requests, {tokens} tokens in {elapsed:.1f} s: "
          f"{out['output_tok_s']:.1f} output tok/s; TTFT mean {out['ttft_mean_s']:.3f} s "
          f"(p50 {out['ttft_p50_s']:.3f}, p99 {out['ttft_p99_s']:.3f}); ITL mean {out['itl_mean_ms']:.1f} ms; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    return out


# ---- in-process ----

def run_in_process(engine, warmup: list[str], prompts: list[str], args, warm: bool) -> dict:
    from jaxserve import SamplingParams
    params = SamplingParams(max_tokens=args.output_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=0, ignore_eos=True)

    waits: list[float] = []  # arrival to admission (time in the waiting queue) of the last closed loop

    def closed_loop(todo: list[str]):
        queue = list(todo)
        live: dict[str, list] = {}  # id -> [submit time, first token time]
        ttft, itl, tokens = [], [], 0
        waits.clear()
        start = time.perf_counter()
        while queue or live:
            while queue and len(live) < args.concurrency:
                live[engine.add_request(queue.pop(0), params)] = [time.perf_counter(), None]
            engine.step()
            now = time.perf_counter()
            for request_id, times in list(live.items()):
                r = engine.request(request_id)
                if times[1] is None and r.output_token_ids:
                    times[1] = now
                if r.finished:
                    waits.append(r.admit_time - r.arrival_time)
                    n = len(r.output_token_ids)
                    ttft.append(times[1] - times[0])
                    itl.append((now - times[1]) / max(1, n - 1))
                    tokens += n
                    engine.release(request_id)
                    del live[request_id]
        return ttft, itl, tokens, time.perf_counter() - start

    if warm:
        closed_loop(warmup)
    before, cpu, first_step = engine.stats(), _cpu_s(os.getpid()), engine.num_steps
    out = summarize("in-process", *closed_loop(prompts))
    after = engine.stats()
    ran = engine.num_steps - first_step  # the last `ran` step records (the history keeps 2048)
    records = list(engine.history)[max(0, len(engine.history) - ran):]
    out["steps"] = _step_summary([dataclasses.asdict(s) for s in records])
    out["compiles_measured"] = after["num_compiles"] - before["num_compiles"]
    out["prefix_cache_hit_rate"] = _hit_rate(after["prefix_cache_hits"] - before["prefix_cache_hits"],
                                             after["prefix_cache_queries"] - before["prefix_cache_queries"])
    out["queue_mean_s"] = statistics.mean(waits)
    print(f"{'':>10}  mean from submission to admission by the scheduler: {out['queue_mean_s']:.3f} s; "
          f"prefix-cache hits {out['prefix_cache_hit_rate']:.0%} of prompt tokens", flush=True)
    out["cpu_s"] = {"engine (this process)": _cpu_s(os.getpid()) - cpu}
    _print_cpu(out)
    return out


# ---- HTTP ----

async def http_closed_loop(url: str, model: str, prompts: list[str], args):
    body = {"model": model, "max_tokens": args.output_tokens, "temperature": args.temperature, "top_k": args.top_k,
            "top_p": args.top_p, "seed": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    calls = (Call("/v1/completions", {**body, "prompt": prompt}) for prompt in prompts)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        start = time.perf_counter()
        ended, _ = await run_pool(client, calls, args.concurrency, math.inf)
        elapsed = time.perf_counter() - start
    for c in ended:
        if c.status != 200 or c.error or math.isnan(c.first):  # TTFT: the first chunk, sent for the first step
            raise RuntimeError(f"{c.ended_as()}: {c.error or c.text[:300]}")
    return ([c.ttft for c in ended], [(c.end - c.first) / max(1, c.tokens() - 1) for c in ended],
            sum(c.tokens() for c in ended), elapsed)


def server_metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {k: float(v) for k, v in re.findall(r"^(jaxserve_\S+) (\S+)$", text, re.M)}


def server_steps(url: str, since: int) -> list[dict]:
    """The engine's step records after step `since` (the state endpoint sends a bounded slice)."""
    steps = []
    while True:
        history = httpx.get(url + "/v1/engine/state", params={"since": since}).json()["history"]
        if not history:
            return steps
        steps += history
        since = history[-1]["step"]


def run_http(url: str, warmup: list[str], prompts: list[str], args, warm: bool, server_pid: int | None) -> dict:
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    if warm:
        asyncio.run(http_closed_loop(url, model, warmup, args))
    before, cpu, client_cpu = server_metrics(url), _server_cpu_s(server_pid), _cpu_s(os.getpid())
    first_step = httpx.get(url + "/v1/engine/state").json()["step"]
    out = summarize("HTTP", *asyncio.run(http_closed_loop(url, model, prompts, args)))
    after = server_metrics(url)
    out["steps"] = _step_summary(server_steps(url, first_step))
    out["cpu_s"] = {k: v - cpu.get(k, 0.0) for k, v in _server_cpu_s(server_pid).items()}
    out["cpu_s"]["client (this process)"] = _cpu_s(os.getpid()) - client_cpu
    _print_cpu(out)
    diff = {k: v - before.get(k, 0) for k, v in after.items()}
    out["compiles_measured"] = diff.get("jaxserve_num_compiles_total")
    out["prefix_cache_hit_rate"] = _hit_rate(diff.get("jaxserve_prefix_cache_hits_total", 0),
                                             diff.get("jaxserve_prefix_cache_queries_total", 0))
    def mean(name):
        count = diff.get(f"jaxserve_{name}_count")
        return diff[f"jaxserve_{name}_sum"] / count if count else None
    out["handoff_mean_s"] = mean("request_handoff_seconds")
    out["queue_mean_s"] = mean("request_queue_time_seconds")
    out["engine_ttft_mean_s"] = mean("time_to_first_token_seconds")
    out["api_ttft_mean_s"] = mean("api_time_to_first_token_seconds")
    if out["engine_ttft_mean_s"] is not None and out["api_ttft_mean_s"] is not None:
        print(f"{'':>10}  means from a request's arrival in the API process: {out['handoff_mean_s']:.3f} s to the "
              f"engine loop taking it, {out['queue_mean_s']:.3f} s to its admission by the scheduler, "
              f"{out['engine_ttft_mean_s']:.3f} s to its first token's sampling, {out['api_ttft_mean_s']:.3f} s to "
              f"the token's HTTP handler; {out['ttft_mean_s'] - out['api_ttft_mean_s']:.3f} s outside the server "
              f"(client, HTTP, SSE); prefix-cache hits {out['prefix_cache_hit_rate']:.0%} of prompt tokens", flush=True)
    return out


def start_server(args) -> ServeProcess:
    server = ServeProcess(args.engine_argv, args.server_log)
    try:
        server.wait_healthy(900)
    except (RuntimeError, TimeoutError) as e:
        server.close()
        raise SystemExit(f"{e}; see {args.server_log}") from None
    return server


def main(argv=None) -> None:
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # this script's options
    own.add_argument("--mode", choices=["both", "in-process", "http"], default="both")
    own.add_argument("--url", default=None, help="benchmark this running server instead of starting one")
    own.add_argument("--concurrency", type=int, default=16)
    own.add_argument("--prompt-tokens", type=int, default=128)
    own.add_argument("--output-tokens", type=int, default=64)
    own.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; OpenAI clients default to 1")
    own.add_argument("--top-k", type=int, default=0, help="top-k sampling, 0 is off (with --temperature > 0)")
    own.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature > 0)")
    own.add_argument("--requests", type=int, default=64)
    own.add_argument("--warmup", type=int, default=16)
    own.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts")
    own.add_argument("--server-pid", type=int, default=None, help="with --url: the server's process, whose "
                        "CPU time (and its children's) is then reported")
    own.add_argument("--rounds", type=int, default=1, help="alternate in-process and HTTP this many times")
    own.add_argument("--server-log", default=os.path.join(tempfile.gettempdir(), "bench_serving_server.log"))
    own.add_argument("--json", default=None, help="write the results here")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     parents=[own])
    add_engine_args(parser)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(raw)
    _, args.engine_argv = own.parse_known_args(raw)  # the server gets exactly the engine options given here
    results = {"cpu": cpu_model(), "load_before": os.getloadavg(), "args": vars(args)}

    from jaxserve.engine.llm_engine import Engine
    from jaxserve.host_memory import keep_freed_memory
    keep_freed_memory()  # as in the server's engine process
    engine = Engine.from_pretrained(args.model, engine_config_from_args(args))
    if args.mode != "http":
        engine.runner.warmup()  # every step shape, as `jaxserve serve` compiles them before it answers
    # Fresh prompts for every round: a repeated prompt would be a prefix-cache hit and skip its prefill.
    prompts = make_prompts(engine.tokenizer, args.warmup + args.rounds * args.requests, args.prompt_tokens,
                           args.prompt_seed)
    warmup = prompts[: args.warmup]
    server, url = None, args.url
    if args.mode in ("both", "http") and url is None:
        server = start_server(args)
        url = server.url
    def measured(i: int) -> list[str]:  # round i's prompts, the same for both sides
        return prompts[args.warmup + i * args.requests: args.warmup + (i + 1) * args.requests]
    modes = {"both": ("in_process", "http"), "in-process": ("in_process",), "http": ("http",)}[args.mode]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        for i in range(args.rounds):
            print(f"round {i + 1} of {args.rounds}", flush=True)
            # Alternating A B, B A, A B, ...: a change in the machine's speed (other tenants) hits both alike.
            for mode in modes if i % 2 == 0 else modes[::-1]:
                if mode == "in_process":
                    runs[mode].append(run_in_process(engine, warmup, measured(i), args, warm=i == 0))
                else:
                    runs[mode].append(run_http(url, warmup, measured(i), args, warm=i == 0,
                                               server_pid=server.pid if server is not None else args.server_pid))
    finally:
        if server is not None:
            server.close(60)
    for mode, rounds in runs.items():
        if any(r.get("compiles_measured") for r in rounds):
            print(f"note: compiles in a measured {mode} phase (raise --warmup)")
        if args.rounds > 1:
            print("all rounds:", end=" ")
        results[mode] = summarize(mode.replace("_", "-") if args.rounds > 1 else mode, *_totals(rounds)) \
            if args.rounds > 1 else rounds[0]
        results[mode]["rounds"] = [{k: v for k, v in r.items() if k not in ("ttft", "itl")} for r in rounds]
        for r in (results[mode], *results[mode]["rounds"]):
            r.pop("ttft", None), r.pop("itl", None)
    if "in_process" in results and "http" in results:
        a, b = results["in_process"], results["http"]
        results["ratio"] = {"output_tok_s": b["output_tok_s"] / a["output_tok_s"],
                            "ttft_mean": b["ttft_mean_s"] / a["ttft_mean_s"], "itl_mean": b["itl_mean_ms"] / a["itl_mean_ms"]}
        r = results["ratio"]
        print(f"{'HTTP / in-process':>10}: output tok/s {r['output_tok_s']:.2f}x, TTFT mean {r['ttft_mean']:.2f}x, "
              f"ITL mean {r['itl_mean']:.2f}x")
        if args.rounds > 1:  # each round's two phases ran back to back, so their ratio drifts least
            per_round = [{"output_tok_s": h["output_tok_s"] / i["output_tok_s"], "ttft_mean": h["ttft_mean_s"] / i["ttft_mean_s"]}
                         for i, h in zip(a["rounds"], b["rounds"])]
            results["ratio_median_of_rounds"] = {k: statistics.median(x[k] for x in per_round) for k in per_round[0]}
            m = results["ratio_median_of_rounds"]
            print(f"{'per round':>10}: output tok/s " + " ".join(f"{x['output_tok_s']:.2f}x" for x in per_round)
                  + ", TTFT mean " + " ".join(f"{x['ttft_mean']:.2f}x" for x in per_round)
                  + f"; medians {m['output_tok_s']:.2f}x and {m['ttft_mean']:.2f}x")
    results["load_after"] = os.getloadavg()
    print(f"CPU: {results['cpu']}; load average before {results['load_before'][0]:.2f}, "
          f"after {results['load_after'][0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads)."""
    import psutil
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _server_cpu_s(pid: int | None) -> dict[str, float]:
    """CPU seconds of the server's engine process and of its others (the API process)."""
    if pid is None:
        return {}
    cpu = cpu_seconds(pid)
    return {"API process": cpu["other"], "engine process": cpu["engine"]}


def _step_summary(steps: list[dict]) -> dict:
    """How the phase's engine steps were filled and paced, from the engine's step records (as
    /v1/engine/state sends them); the interval runs from one step's dispatch to the next's."""
    if not steps:
        return {"count": 0}
    out = {"count": len(steps), "tokens_mean": statistics.mean(s["tokens"] for s in steps),
           "decode_rows_mean": statistics.mean(s["decode_rows"] for s in steps),
           "interval_ms_mean": 1000 * (steps[-1]["time"] - steps[0]["time"]) / max(1, len(steps) - 1)}
    print(f"{'':>10}  engine steps: {out['count']}, {out['tokens_mean']:.1f} tokens each "
          f"({out['decode_rows_mean']:.1f} decode rows), one every {out['interval_ms_mean']:.1f} ms", flush=True)
    return out


def _print_cpu(out: dict) -> None:
    per_k = {k: 1000 * v / out["output_tokens"] for k, v in out["cpu_s"].items()}
    print(f"{'':>10}  CPU seconds per 1000 output tokens: "
          + ", ".join(f"{k} {v:.2f}" for k, v in per_k.items()), flush=True)


def _totals(rounds: list[dict]):
    """(ttft, itl, tokens, elapsed) over all rounds."""
    return ([t for r in rounds for t in r["ttft"]], [t for r in rounds for t in r["itl"]],
            sum(r["output_tokens"] for r in rounds), sum(r["elapsed_s"] for r in rounds))


def _hit_rate(hits: float, queries: float) -> float:
    return hits / queries if queries else 0.0


if __name__ == "__main__":
    main()
