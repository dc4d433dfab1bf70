"""Shared by scripts/soak.py and scripts/fault_drill.py: a `jaxserve serve` subprocess on loopback,
its two processes' PIDs, memory and file descriptors (read from /proc, Linux only), /metrics, and
one streaming completion read event by event.

The engine process is the API process's child started by multiprocessing's spawn (its command
line holds `spawn_main`; jaxserve/entrypoints/engine_supervisor.py), so it is found again after a restart.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- processes, from /proc ----

def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after the last ')'
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def engine_pid(server_pid: int) -> int | None:
    """The engine process of the `jaxserve serve` process `server_pid` (None while there is none)."""
    return next((c for c in children(server_pid) if "spawn_main" in cmdline(c)), None)


def rss_mib(pid: int | None) -> float:
    """VmRSS of `pid` in MiB (nan if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kib = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M)
        return int(kib.group(1)) / 1024 if kib else float("nan")
    except (OSError, TypeError):
        return float("nan")


def open_fds(pid: int | None) -> float:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, TypeError):
        return float("nan")


def listening_pid(port: int) -> int | None:
    """The PID of this user's process listening on TCP `port` (via /proc/net/tcp{,6} and the
    processes' fds), or None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                if os.readlink(f"/proc/{entry}/fd/{fd}") in inodes:
                    return int(entry)
        except OSError:
            continue
    return None


# ---- the server ----

def wait_for_health(url: str, procs: list[subprocess.Popen], timeout: float = 900.0) -> None:
    """Waits for `url`'s /health to say 200; RuntimeError if one of `procs` (the server's) exits
    first, TimeoutError past `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"jaxserve serve (pid {proc.pid}) exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"jaxserve serve did not start within {timeout:.0f} s")
        time.sleep(0.2)


class ServeProcess:
    """`jaxserve serve --port <free> ARGS` in a subprocess, its output in `log_path`."""

    def __init__(self, args: list[str] | str, log_path: str, env: dict | None = None):
        if isinstance(args, str):
            args = shlex.split(args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.pid = self.proc.pid

    def wait_healthy(self, timeout: float = 900.0) -> float:
        """Waits for /health to say 200; returns the seconds since the launch."""
        try:
            wait_for_health(self.url, [self.proc], timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{e}:\n{self.output()[-3000:]}") from None
        except TimeoutError as e:
            raise TimeoutError(f"{e} (log: {self.log_path})") from None
        return time.monotonic() - self.started_at

    def engine_pid(self) -> int | None:
        return engine_pid(self.pid)

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def close(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


# ---- /metrics ----

def parse_metrics(text: str) -> dict[str, float]:
    """Every sample of the Prometheus text format, by its name with labels."""
    return {m[0]: float(m[1]) for m in re.findall(r"^([^#\s]\S*) (\S+)$", text, re.M)}


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


def idle(m: dict[str, float]) -> bool:
    return m.get("jaxserve_kv_pages_used") == 0 and m.get("jaxserve_num_requests_running") == 0 \
        and m.get("jaxserve_num_requests_waiting") == 0


def wait_idle(url: str, timeout: float = 30.0) -> tuple[dict[str, float], float]:
    """Polls /metrics until no request runs or waits and no KV page is held by a sequence, or
    until `timeout`; returns the last metrics and the seconds waited."""
    start = time.monotonic()
    while True:
        m = metrics(url)
        if idle(m) or time.monotonic() - start > timeout:
            return m, time.monotonic() - start
        time.sleep(0.1)


# ---- one stream ----

class Stream:
    """A streaming request read as its SSE events come: `events` (data payloads, [DONE] included),
    when it started, got its first event and ended, and how it ended (`outcome`)."""

    def __init__(self, client: httpx.AsyncClient, path: str, body: dict):
        self.events: list[str] = []
        self.status: int | None = None
        self.outcome: str | None = None  # done, no-done, http-<status> or an exception's name
        self.first = asyncio.Event()
        self.started = time.monotonic()
        self.ended: float | None = None
        self.task = asyncio.ensure_future(self._read(client, path, body))

    async def _read(self, client, path, body) -> None:
        try:
            async with client.stream("POST", path, json=body) as r:
                self.status = r.status_code
                if r.status_code != 200:
                    await r.aread()
                    self.outcome = f"http-{r.status_code}"
                    return
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()
            self.outcome = "done" if self.events and self.events[-1] == "[DONE]" else "no-done"
        except (httpx.HTTPError, OSError) as e:
            self.outcome = type(e).__name__
        finally:
            self.ended = time.monotonic()
            self.first.set()

    def chunks(self) -> list[dict]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    def errors(self) -> list[dict]:
        return [c["error"] for c in self.chunks() if "error" in c]

    def finish_reasons(self) -> list[str]:
        return [ch["finish_reason"] for c in self.chunks() for ch in c.get("choices") or () if ch.get("finish_reason")]

    def completion_tokens(self) -> int | None:
        usage = [c["usage"] for c in self.chunks() if c.get("usage")]
        return usage[-1]["completion_tokens"] if usage else None


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        found = re.search(r"^Model name:\s+(.+)$", out, re.M)
        cores = re.search(r"^CPU\(s\):\s+(\d+)$", out, re.M)
        if found:
            return found.group(1).strip() + (f", {cores.group(1)} CPUs" if cores else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown CPU"
