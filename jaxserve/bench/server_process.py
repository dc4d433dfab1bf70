"""`jaxserve serve` in a subprocess on loopback, for the load scripts: started on a free port,
awaited until /health says 200, stopped with SIGTERM; and its processes' memory, file descriptors
and CPU time.

The engine process is a child started by multiprocessing's spawn (its command line holds
`spawn_main`; jaxserve/entrypoints/engine_supervisor.py), so it is found again after a restart. Under `--replicas`
every replica's engine process is one, deeper in the process tree (Ray's workers).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jaxserve_command() -> str:
    """The `jaxserve` console script of this Python's environment (else the one on PATH)."""
    beside = os.path.join(os.path.dirname(sys.executable), "jaxserve")
    found = beside if os.path.exists(beside) else shutil.which("jaxserve")
    if found is None:
        raise RuntimeError("no `jaxserve` command: install jaxserve (pip install -e '.[server]')")
    return found


class ServeProcess:
    """`jaxserve serve ARGS --host 127.0.0.1 --port <free>` in a process group of its own, its
    output in `log_path`."""

    def __init__(self, args: list[str], log_path: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command = [jaxserve_command(), "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.started_at = time.monotonic()
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(env or {})}, start_new_session=True)
        self.pid = self.proc.pid

    def wait_healthy(self, timeout: float) -> float:
        """Waits for /health to say 200; returns the seconds since the start. RuntimeError if the
        server exits first, TimeoutError past `timeout` seconds."""
        deadline = self.started_at + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jaxserve serve exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.started_at
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"jaxserve serve did not start within {timeout:.0f} s (log: {self.log_path})")
            time.sleep(0.2)

    def engine_pids(self) -> list[int]:
        return engine_pids(self.pid)

    def output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def close(self, timeout: float = 120.0) -> int | None:
        """SIGTERM (a graceful drain), then SIGKILL to the whole process group past `timeout`;
        returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(30)
        return self.proc.returncode


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _is_engine(p: psutil.Process) -> bool:
    try:
        return "spawn_main" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def engine_pids(server_pid: int) -> list[int]:
    """The engine processes under the `jaxserve serve` process `server_pid` (none while it restarts)."""
    return [p.pid for p in _tree(server_pid)[1:] if _is_engine(p)]


def rss_mib(pid: int | None) -> float:
    """Resident memory of `pid` in MiB (nan if it is gone)."""
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except (psutil.Error, TypeError, ValueError):
        return float("nan")


def open_fds(pid: int | None) -> float:
    try:
        return psutil.Process(pid).num_fds()
    except (psutil.Error, TypeError, ValueError):
        return float("nan")


def cpu_seconds(server_pid: int) -> dict[str, float]:
    """User + system CPU seconds used so far by the server's process tree: the engine processes,
    and all the others (the API process; under Ray also Ray's own processes and the replicas' apps)."""
    out = {"engine": 0.0, "other": 0.0}
    for p in _tree(server_pid):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        out["engine" if _is_engine(p) else "other"] += t.user + t.system
    return out


def listening_pid(port: int) -> int | None:
    """The process of this user listening on TCP `port`, or None."""
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid is not None:
            return c.pid
    return None


def cpu_model() -> str:
    """The CPU's model name and how many CPUs this machine has."""
    try:
        with open("/proc/cpuinfo") as f:
            name = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
    except OSError:
        name = None
    return f"{name.group(1).strip() if name else 'unknown CPU'}, {os.cpu_count()} CPUs"
