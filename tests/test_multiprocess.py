"""One engine over two processes (a (2, 4) mesh of 4 simulated CPU devices each, gloo collectives)
samples the same greedy tokens as one device, and both processes see them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "multiprocess_generate.py")
TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_two_processes_match_one_device():
    env = dict(os.environ)  # with the suite's XLA_FLAGS (conftest.py): the script adds its device count
    port = free_port()
    procs = [subprocess.Popen([sys.executable, SCRIPT, "--process-id", str(i), "--num-processes", "2",
                               "--port", str(port), "--mesh", "data=2,model=4"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outputs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
            assert proc.returncode == 0, f"process failed:\n{stdout[-2000:]}\n{stderr[-4000:]}"
            outputs.append(last_json(stdout))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    single = subprocess.run([sys.executable, SCRIPT, "--single"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=TIMEOUT_S)
    assert single.returncode == 0, single.stderr[-4000:]
    expected = last_json(single.stdout)["tokens"]
    assert [o["process"] for o in outputs] == [0, 1]
    assert outputs[0]["tokens"] == expected
    assert outputs[1]["tokens"] == expected
