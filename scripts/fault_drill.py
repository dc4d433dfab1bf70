"""Fault drill of `jaxserve serve` (issue 26's targets), each drill against a server it launches:

  kill    `kill -9` the engine process under --streams concurrent streams: every stream in flight
          ends within 2 s (with an error event and [DONE]; none hangs), a generation succeeds again
          within 30 s (the new engine process loads its steps from the compile cache: warm), and
          then 0 KV pages are held and jaxserve_engine_restarts_total is 1.
  sigterm SIGTERM the server with --streams requests in flight and --shutdown-timeout 30: all of
          them complete, a new request during the drain gets 503 (or the connection is refused once
          the listener closes: the table says which), and the server exits 0.

Prints a table of the figures with a pass/fail per target; exit 1 if any fails.

    python scripts/fault_drill.py                       # Gemma 3 270M, both drills
    python scripts/fault_drill.py --model /tmp/tiny --serve-args "--max-model-len 512" --kill-tokens 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_process import ServeProcess, Stream, cpu_model, wait_idle  # noqa: E402

ENDED_S = 2.0
BACK_S = 30.0
PROGRAMS = re.compile(r"(\d+) step programs ready in ([\d.]+) s: (\d+) compiled, (\d+) loaded from the compile cache")
STOPPED = re.compile(r"the engine stops with (\d+) KV pages held by sequences")


def serve_args(args, *more: str) -> list[str]:
    return [*(["--model", args.model] if args.model else []), *shlex.split(args.serve_args), *more]


def launch(args, name: str, *more: str) -> ServeProcess:
    log = os.path.join(args.log_dir, f"fault-drill-{name}.log")
    server = ServeProcess(serve_args(args, *more), log)
    print(f"[{name}] jaxserve serve {' '.join(serve_args(args, *more))} (pid {server.pid}, log {log})", flush=True)
    took = server.wait_healthy(args.start_timeout)
    found = PROGRAMS.findall(server.output())
    print(f"[{name}] healthy after {took:.1f} s"
          + (f"; {found[0][0]} step programs in {found[0][1]} s: {found[0][2]} compiled, {found[0][3]} loaded"
             if found else ""), flush=True)
    return server


def stream_body(i: int, max_tokens: int) -> dict:
    return {"prompt": f"Write a long story about the number {i}.", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def start_streams(client, n: int, max_tokens: int, timeout: float) -> list[Stream]:
    streams = [Stream(client, "/v1/completions", stream_body(i, max_tokens)) for i in range(n)]
    await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), timeout)
    return streams


def figure(rows, drill, name, value, target="", ok=None):
    rows.append({"drill": drill, "figure": name, "value": value, "target": target, "pass": ok})


async def kill_drill(args, rows: list[dict]) -> None:
    server = launch(args, "kill")
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(600)) as client:
            streams = await start_streams(client, args.streams, args.kill_tokens, args.start_timeout)
            early = sum(s.ended is not None for s in streams)
            engine = server.engine_pid()
            load = os.getloadavg()[0]
            os.kill(engine, signal.SIGKILL)
            killed = time.monotonic()
            print(f"[kill] kill -9 {engine} under {args.streams} streams ({early} had already ended)", flush=True)
            _, hung = await asyncio.wait([s.task for s in streams], timeout=args.hang_s)
            ended = [s.ended - killed for s in streams if s.ended is not None]
            with_error = sum(bool(s.errors()) and s.outcome == "done" for s in streams)
            # Generations again: one small request after another until one succeeds.
            statuses: dict[str, int] = {}
            back = None
            while time.monotonic() - killed < args.back_timeout:
                try:
                    r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4,
                                                                  "ignore_eos": True}, timeout=30)
                    key = str(r.status_code)
                    if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4:
                        back = time.monotonic() - killed
                        break
                except httpx.HTTPError as e:
                    key = type(e).__name__
                statuses[key] = statuses.get(key, 0) + 1
                await asyncio.sleep(0.1)
            for task in hung:
                task.cancel()
        m, _ = await asyncio.to_thread(wait_idle, server.url, 30)
        new_engine = server.engine_pid()
        output = server.output()
        restart = PROGRAMS.findall(output.split("starting a new engine process", 1)[-1]) \
            if "starting a new engine process" in output else []
    finally:
        code = server.close()
    figure(rows, "kill", "load average (1 min) at the kill", f"{load:.1f}", "", None)
    figure(rows, "kill", "streams in flight at the kill", f"{args.streams - early} of {args.streams}", "",
           None)
    figure(rows, "kill", "max time from kill -9 to a stream's end",
           f"{max(ended):.3f} s" if ended else "none ended", f"<= {ENDED_S:g} s",
           bool(ended) and max(ended) <= ENDED_S and not hung)
    figure(rows, "kill", "streams hung (not ended within "
           f"{args.hang_s:g} s)", len(hung), "0", not hung)
    figure(rows, "kill", "streams ended with an error event and [DONE]", f"{with_error} of {args.streams}",
           f"{args.streams - early}", with_error >= args.streams - early)
    figure(rows, "kill", "answers while the engine restarted", ", ".join(f"{k} x{v}" for k, v in statuses.items())
           or "none", "", None)
    warm = bool(restart) and restart[0][2] == "0"
    figure(rows, "kill", "restarted engine's step programs",
           f"{restart[0][0]} in {restart[0][1]} s: {restart[0][2]} compiled, {restart[0][3]} loaded ("
           f"{'warm' if warm else 'COLD'} cache)" if restart else "no restart logged", "0 compiled (warm)", warm)
    figure(rows, "kill", "kill -9 to a generation succeeding again", f"{back:.1f} s" if back else "never",
           f"<= {BACK_S:g} s", back is not None and back <= BACK_S)
    pages, restarts = m.get("jaxserve_kv_pages_used"), m.get("jaxserve_engine_restarts_total")
    figure(rows, "kill", "KV pages held afterwards", pages, "0", pages == 0)
    figure(rows, "kill", "jaxserve_engine_restarts_total", restarts, "1", restarts == 1)
    figure(rows, "kill", "engine pid", f"{engine} -> {new_engine}", "new", new_engine not in (None, engine))
    figure(rows, "kill", "server exit code at the end (SIGTERM)", code, "0", code == 0)


async def sigterm_drill(args, rows: list[dict]) -> None:
    server = launch(args, "sigterm", "--shutdown-timeout", f"{args.shutdown_timeout:g}")
    probes: list[str] = []
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(600)) as client:
            streams = await start_streams(client, args.streams, args.drain_tokens, args.start_timeout)
            in_flight = sum(s.ended is None for s in streams)
            load = os.getloadavg()[0]
            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            print(f"[sigterm] SIGTERM with {in_flight} streams in flight", flush=True)
            # A request sent right after the signal may arrive before the server has seen it: retry
            # (one token each) until one is refused.
            for _ in range(50):
                try:
                    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
                    code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
                    probes.append(f"{r.status_code}" + (f" {code}" if code else ""))
                    if r.status_code != 200:
                        break
                except httpx.HTTPError as e:
                    probes.append(type(e).__name__)
                    break
                await asyncio.sleep(0.05)
            probe_at = time.monotonic() - signalled
            in_flight_at_probe = sum(s.ended is None for s in streams)
            _, hung = await asyncio.wait([s.task for s in streams], timeout=args.shutdown_timeout + 30)
            for task in hung:
                task.cancel()
        try:
            code = await asyncio.to_thread(server.proc.wait, 60)
        except subprocess.TimeoutExpired:
            code = "still running after 60 s"
        exited = time.monotonic() - signalled
        stopped = STOPPED.findall(server.output())
    finally:
        server.close()
    complete = sum(s.outcome == "done" and not s.errors() and s.finish_reasons()[-1:] == ["length"]
                   and s.completion_tokens() == args.drain_tokens for s in streams)
    last_end = max((s.ended for s in streams if s.ended), default=signalled) - signalled
    figure(rows, "sigterm", "load average (1 min) at SIGTERM", f"{load:.1f}", "", None)
    figure(rows, "sigterm", "requests in flight at SIGTERM", f"{in_flight} of {args.streams}", str(args.streams),
           in_flight == args.streams)
    figure(rows, "sigterm", f"completed ({args.drain_tokens} tokens, finish_reason length, no error)",
           f"{complete} of {args.streams}", str(args.streams), complete == args.streams)
    figure(rows, "sigterm", "SIGTERM to the last stream's end", f"{last_end:.1f} s",
           f"<= {args.shutdown_timeout:g} s", last_end <= args.shutdown_timeout)
    refused = probes[-1] if probes else "none sent"
    figure(rows, "sigterm", "new request during the drain",
           f"{refused} at +{probe_at:.2f} s ({in_flight_at_probe} streams still in flight; "
           f"{len(probes) - 1} probes accepted before)", "503 (or connection refused)",
           refused.startswith("503") or refused == "ConnectError")
    figure(rows, "sigterm", "KV pages held when the engine stopped", stopped[-1] if stopped else "not logged", "0",
           stopped[-1:] == ["0"])
    figure(rows, "sigterm", "exit code", code, "0", code == 0)
    figure(rows, "sigterm", "SIGTERM to exit", f"{exited:.1f} s", "", None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: jaxserve's default model (Gemma 3 270M)")
    parser.add_argument("--serve-args", default="", help="more `jaxserve serve` options, one string")
    parser.add_argument("--drills", default="kill,sigterm", help="which drills, comma-separated")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--kill-tokens", type=int, default=256, help="tokens each stream asks for in the kill drill")
    parser.add_argument("--drain-tokens", type=int, default=64, help="tokens each request asks for in the sigterm drill")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0)
    parser.add_argument("--hang-s", type=float, default=30.0, help="a stream not ended this long after the kill hangs")
    parser.add_argument("--back-timeout", type=float, default=300.0, help="give up waiting for a generation after")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--log-dir", default=None, help="the servers' output (default: a temporary folder)")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="fault-drill-")
    os.makedirs(args.log_dir, exist_ok=True)
    drills = {"kill": kill_drill, "sigterm": sigterm_drill}
    chosen = args.drills.split(",")
    if not chosen or any(d not in drills for d in chosen):
        parser.error(f"--drills takes a comma-separated subset of {', '.join(drills)}")
    rows: list[dict] = []
    for d in chosen:
        asyncio.run(drills[d](args, rows))
    cpu = cpu_model()
    print(f"\nCPU: {cpu}; model: {args.model or 'Gemma 3 270M (default)'}\n")
    print("| drill | figure | value | target | pass |\n|---|---|---|---|---|")
    for r in rows:
        ok = "" if r["pass"] is None else "PASS" if r["pass"] else "FAIL"
        print(f"| {r['drill']} | {r['figure']} | {r['value']} | {r['target']} | {ok} |")
    passed = all(r["pass"] is not False for r in rows)
    print("PASS" if passed else "FAIL")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "args": vars(args), "figures": rows, "pass": passed}, f, indent=1, default=str)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
