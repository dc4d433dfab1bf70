"""Replicas behind Ray Serve (jaxserve/entrypoints/ray_serve.py), measured against one engine.

The workload: --groups groups of --per-group completions; every prompt of a group starts with the
group's own --prefix random token ids and ends with --suffix ids of its own; each asks for
--max-tokens tokens (ignore_eos, so every run generates as many). The requests go in a shuffled
order (one seed), --concurrency at a time, after a warm-up pass of other prefixes.

Configurations, each a `jaxserve serve` in a subprocess on loopback:
  direct       one engine, no Ray                    the hit rate of one replica serving everything
  ray-1        --replicas 1 (through Serve's proxy)  throughput vs direct: the Ray overhead
  prefix       --replicas 2 --router prefix          Ray's PrefixCacheAffinityRouter
  round-robin  --replicas 2 --router round-robin
  pow2         --replicas 2 --router pow2            Ray's default router

Prints per configuration: requests/s, output tok/s, the summed prefix-cache hit rate (cached prompt
tokens over prompt tokens, from usage.prompt_tokens_details.cached_tokens), how the requests
split over replicas (the x-jaxserve-replica header), and the CPU seconds the server's processes
used during the pass: the engine processes, and all the others (the API process; under Ray also
Ray's own processes, the proxy, the ingress and the replicas' apps); then the ratios of the
issue's targets.

    python scripts/bench_replicas.py --model tiny              # a tiny random Llama, built here
    python scripts/bench_replicas.py                            # Gemma 3 270M
    python scripts/bench_replicas.py --configs direct,ray-1 --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
REPLICA_HEADER = "x-jaxserve-replica"
CONFIGS = {"direct": [], "ray-1": ["--replicas", "1"], "prefix": ["--replicas", "2", "--router", "prefix"],
           "round-robin": ["--replicas", "2", "--router", "round-robin"],
           "pow2": ["--replicas", "2", "--router", "pow2"]}


def tiny_model(folder: str) -> str:
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from conftest import build_checkpoint
    return build_checkpoint(folder, "llama", max_position_embeddings=2048)


def workload(args, seed: int, vocab: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    low, high = vocab
    prompts = []
    for _ in range(args.groups):
        prefix = [rng.randrange(low, high) for _ in range(args.prefix)]
        prompts += [prefix + [rng.randrange(low, high) for _ in range(args.suffix)] for _ in range(args.per_group)]
    rng.shuffle(prompts)
    return prompts


async def send(url: str, prompts: list[list[int]], args) -> dict:
    gate = asyncio.Semaphore(args.concurrency)
    out = []

    async def one(client, prompt):
        async with gate:
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": args.max_tokens,
                                                           "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            usage = r.json()["usage"]
            out.append((r.headers.get(REPLICA_HEADER, "-"), usage["prompt_tokens"],
                        usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]))

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, p) for p in prompts))
        elapsed = time.perf_counter() - start
    prompt_tokens = sum(o[1] for o in out)
    return {"seconds": elapsed, "requests_per_s": len(out) / elapsed,
            "output_tok_per_s": sum(o[3] for o in out) / elapsed,
            "hit_rate": sum(o[2] for o in out) / prompt_tokens,
            "by_replica": dict(collections.Counter(o[0] for o in out))}


class Server:
    def __init__(self, args, model: str, extra: list[str], port: int, log_path: str):
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        engine = ["--max-slots", str(args.max_slots), "--max-model-len", str(args.max_model_len),
                  *(["--num-pages", str(args.num_pages)] if args.num_pages else []), *args.engine_args]
        actor = ["--ray-actor-options", json.dumps({"num_cpus": 0})] if "--replicas" in extra else []
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--port", str(port),
                                      *(["--model", model] if model else []), *engine, *extra, *actor],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + args.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the server did not start in {args.start_timeout} s; see {log_path}")
            time.sleep(1)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by the server's process tree: {"engine": ..., "other": ...}
        (engine processes are multiprocessing's spawned children)."""
        out = {"engine": 0.0, "other": 0.0}
        root = psutil.Process(self.proc.pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                times = p.cpu_times()
                kind = "engine" if "spawn_main" in " ".join(p.cmdline()) else "other"
            except psutil.Error:
                continue
            out[kind] += times.user + times.system
        return out

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a checkpoint; 'tiny': a tiny random Llama built here "
                                                      "(default: Gemma 3 270M)")
    parser.add_argument("--configs", default="direct,ray-1,prefix,round-robin,pow2")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="measured passes per server (new prefixes each)")
    parser.add_argument("--max-slots", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-pages", type=int, default=None)
    parser.add_argument("--engine-args", default="", help="more `jaxserve serve` options, e.g. '--dtype float32'")
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    args.engine_args = args.engine_args.split()
    folder = tempfile.mkdtemp(prefix="bench-replicas-")
    model = tiny_model(os.path.join(folder, "tiny")) if args.model == "tiny" else args.model
    vocab = (10, 150) if args.model == "tiny" else (1000, 200_000)
    results = {}
    for name in args.configs.split(","):
        start = time.perf_counter()
        server = Server(args, model, CONFIGS[name], args.port, os.path.join(folder, f"{name}.log"))
        started = time.perf_counter() - start
        try:
            asyncio.run(send(server.url, workload(args, 1000, vocab)[: args.concurrency * 2], args))  # warm-up
            runs = []
            for seed in range(args.repeats):
                before = server.cpu_seconds()
                runs.append(asyncio.run(send(server.url, workload(args, seed, vocab), args)))
                after = server.cpu_seconds()
                runs[-1]["cpu_s"] = {k: after[k] - before[k] for k in after}
        finally:
            server.stop()
        results.setdefault(name, []).extend(runs)  # a configuration named twice: both servers' passes
        for run in runs:
            print(f"{name:12s} started in {started:5.1f} s: {run['requests_per_s']:6.2f} req/s "
                  f"{run['output_tok_per_s']:7.1f} out tok/s  hit rate {run['hit_rate']:.3f}  "
                  f"({run['seconds']:.1f} s) replicas {sorted(run['by_replica'].values(), reverse=True)}  "
                  f"CPU s: engine {run['cpu_s']['engine']:.1f}, other {run['cpu_s']['other']:.1f}", flush=True)

    def mean(name, key):
        return sum(r[key] for r in results[name]) / len(results[name])
    if "direct" in results:
        for name in ("prefix", "round-robin", "pow2"):
            if name in results:
                print(f"hit rate {name} / one engine: {mean(name, 'hit_rate') / mean('direct', 'hit_rate'):.3f}")
        if "ray-1" in results:
            ratio = mean("ray-1", "output_tok_per_s") / mean("direct", "output_tok_per_s")
            print(f"throughput ray-1 / direct: {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    print(f"logs in {folder}")


if __name__ == "__main__":
    main()
