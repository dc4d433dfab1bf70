"""Step time of a multi-host group against one process with the same mesh: `jaxserve serve` over a
model=4 mesh, as 1 process of 4 simulated CPU devices and as 2 processes of 2 (gloo collectives,
loopback), plus one process of one device for scale; the same workload over HTTP for each.

    python scripts/bench_multihost.py                        # builds a random Llama under /tmp
    python scripts/bench_multihost.py --configs 1x4,2x2 --passes 3
    python scripts/bench_multihost.py --configs 1x4:data=2+model=2,2x2:data=2+model=2   # another mesh

The workload: `--requests` concurrent completions of `--prompt-tokens` random token ids, each
asking for `--max-tokens` tokens (ignore_eos), after one warm-up pass. The figures: output tokens/s
over a pass, and the mean time per output token after the first (TPOT from /metrics), which with
every request decoding together is the decode step time. On one machine both configurations
share the same cores; only their ratio says anything, and only about this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
from serve_process import free_port, wait_for_health

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=8, vocab_size=8192, max_position_embeddings=1024)
ENGINE = ("--max-slots", "8", "--page-size", "16", "--num-pages", "256", "--max-model-len", "512",
          "--max-num-batched-tokens", "128", "--dtype", "float32")


def build_model(path: str) -> str:
    if not os.path.exists(os.path.join(path, "config.json")):
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from conftest import build_checkpoint
        build_checkpoint(path, "llama", **SHAPE)
    return path


def start(config: str, model: str, cache: str, log_dir: str) -> tuple[list[subprocess.Popen], str]:
    """Processes of `config` ("1x1", "1x4": one process of 4 devices, "2x2": two of 2; a mesh after
    a colon, axes joined by "+", else model over every device)."""
    config, _, mesh_text = config.partition(":")
    processes, devices = map(int, config.split("x"))
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXSERVE_CACHE=cache,
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    mesh = (("--mesh", mesh_text.replace("+", ",")) if mesh_text else
            () if processes * devices == 1 else ("--mesh", f"model={processes * devices}"))
    base = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--model", model, *ENGINE, *mesh]
    group = () if processes == 1 else ("--num-processes", str(processes), "--coordinator", f"127.0.0.1:{free_port()}")
    procs = []
    for i in range(processes):
        extra = ("--port", str(port)) if i == 0 else ()
        log = open(os.path.join(log_dir, f"{config}-{mesh_text}-{i}.log"), "w")
        procs.append(subprocess.Popen(base + list(group) + (["--process-id", str(i)] if group else []) + list(extra),
                                      cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, procs)
    except (RuntimeError, TimeoutError) as e:
        raise SystemExit(f"{config}: {e}: see {log_dir}") from None
    return procs, url


def tpot(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics").text
    get = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # noqa: E731
    return (get("jaxserve_time_per_output_token_seconds_sum"), get("jaxserve_time_per_output_token_seconds_count"))


async def one_pass(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        replies = await asyncio.gather(*(client.post("/v1/completions", json={
            "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}) for p in prompts))
        elapsed = time.perf_counter() - start
    for r in replies:
        r.raise_for_status()
    return elapsed, sum(r.json()["usage"]["completion_tokens"] for r in replies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.path.join(tempfile.gettempdir(), "jaxserve-bench-multihost-llama"))
    parser.add_argument("--configs", default="1x1,1x4,2x2")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    model = build_model(args.model)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, SHAPE["vocab_size"], args.prompt_tokens).tolist() for _ in range(args.requests)]
    log_dir = tempfile.mkdtemp(prefix="bench-multihost-")
    cache = os.path.join(log_dir, "cache")
    rows = []
    for config in args.configs.split(","):
        procs, url = start(config, model, cache, log_dir)
        try:
            asyncio.run(one_pass(url, prompts, args.max_tokens))  # warm-up
            rates, steps = [], []
            for _ in range(args.passes):
                before = tpot(url)
                elapsed, tokens = asyncio.run(one_pass(url, prompts, args.max_tokens))
                after = tpot(url)
                rates.append(tokens / elapsed)
                steps.append((after[0] - before[0]) / (after[1] - before[1]) * 1e3)
            rows.append((config, rates, steps))
            print(f"{config}: out tok/s {', '.join(f'{r:.1f}' for r in rates)}; TPOT ms "
                  f"{', '.join(f'{s:.1f}' for s in steps)}", flush=True)
        finally:
            procs[0].send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
    print(f"\n{args.requests} requests x {args.prompt_tokens} prompt tokens -> {args.max_tokens} tokens; "
          f"model {SHAPE}; {args.passes} passes after a warm-up (logs: {log_dir})")
    print(f"{'processes x devices':<26} {'out tok/s':>10} {'TPOT ms (decode step)':>22}")
    for config, rates, steps in rows:
        print(f"{config:<26} {np.mean(rates):>10.1f} {np.mean(steps):>22.1f}")


if __name__ == "__main__":
    main()
