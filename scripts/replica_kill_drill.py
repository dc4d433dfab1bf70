"""A replica killed under load (issue 28's "nothing lost"), on `jaxserve serve --replicas 2`.

Starts the server (round-robin routing, so the streams split over both replicas), opens --streams
streams of --tokens tokens, and once each has its first event kills one replica's actor with
`ray.kill` (Ray's way to make an actor die as in a crash). Then it reports:
  - the killed replica's streams: how each ended (an error event, a broken connection, or `[DONE]`
    with every token) and how long after the kill; the survivor's streams must finish whole;
  - requests sent after the kill: which replica served each (all must be the survivor's, or errors
    while the proxy learns the replica is gone);
  - how long until Serve has replaced the replica (a request served by a new replica id).

    python scripts/replica_kill_drill.py --model tiny
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import traceback

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_replicas import REPLICA_HEADER, Server, tiny_model  # noqa: E402


async def stream(client, tokens: int, first: asyncio.Event, out: dict):
    body = {"prompt": "the quick brown fox", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    events = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            out["replica"] = r.headers.get(REPLICA_HEADER)
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                first.set()
                data = line[6:]
                if data == "[DONE]":
                    out["end"] = out.get("end") or "done"
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out["end"] = "error event"
                else:
                    events += 1
    except httpx.HTTPError as e:
        out["end"] = f"connection: {type(e).__name__}"
    first.set()
    out["events"], out["at"] = events, time.monotonic()


async def drill(url: str, args) -> None:
    import ray
    ray.init(address="auto", namespace="serve", log_to_driver=False)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        ids = set()
        while len(ids) < 2:  # round-robin: the replicas' ids, so that the kill waits for no lookup
            r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
            ids.add(r.headers[REPLICA_HEADER])
        actors = {i: ray.get_actor(f"SERVE_REPLICA::jaxserve#engine#{i}", namespace="serve") for i in ids}
        outs = [{} for _ in range(args.streams)]
        firsts = [asyncio.Event() for _ in range(args.streams)]
        tasks = [asyncio.create_task(stream(client, args.tokens, f, o)) for f, o in zip(firsts, outs)]
        await asyncio.gather(*(f.wait() for f in firsts))
        victim = outs[0]["replica"]
        actor = actors[victim]
        killed = time.monotonic()
        ray.kill(actor, no_restart=True)
        print(f"killed replica {victim}; streams per replica: "
              f"{sorted((o['replica'] for o in outs), key=lambda r: r != victim)}", flush=True)
        after, replaced = [], None
        while time.monotonic() - killed < args.watch:
            try:
                r = await client.post("/v1/completions", json={"prompt": "a stitch in time", "max_tokens": 2})
                served = r.headers.get(REPLICA_HEADER) if r.status_code == 200 else f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                served = f"connection: {type(e).__name__}"
            after.append((round(time.monotonic() - killed, 1), served))
            if served not in (victim, None) and not served.startswith(("HTTP", "connection")) \
                    and served not in {o["replica"] for o in outs}:
                replaced = time.monotonic() - killed
                break
            await asyncio.sleep(0.5)
        await asyncio.gather(*tasks)
    for o in outs:
        who = "killed" if o["replica"] == victim else "survivor"
        print(f"  {who:8s} stream: {o.get('end')}, {o['events']} token events, ended {o['at'] - killed:+.1f} s "
              "after the kill")
    served_by = {}
    for _, s in after:
        served_by[s] = served_by.get(s, 0) + 1
    print(f"requests after the kill, by who answered: {served_by}")
    print(f"first and last: {after[:3]} ... {after[-3:]}")
    print(f"replaced after {replaced:.1f} s" if replaced else f"not replaced within {args.watch} s")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=480)
    parser.add_argument("--watch", type=float, default=180, help="seconds to wait for the replacement")
    parser.add_argument("--port", type=int, default=8124)
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="replica-kill-")
    model = tiny_model(os.path.join(folder, "tiny")) if args.model == "tiny" else args.model
    opts = argparse.Namespace(max_slots=16, max_model_len=512, num_pages=None, start_timeout=900,
                              engine_args=["--dtype", "float32"] if args.model == "tiny" else [])
    server = Server(opts, model, ["--replicas", "2", "--router", "round-robin"], args.port,
                    os.path.join(folder, "serve.log"))
    try:
        asyncio.run(drill(server.url, args))
    except BaseException:
        traceback.print_exc()  # now: stopping the server ends the Ray cluster, and this process with it
        sys.stderr.flush()
        raise
    finally:
        server.stop()
    print(f"log in {folder}/serve.log")


if __name__ == "__main__":
    main()
