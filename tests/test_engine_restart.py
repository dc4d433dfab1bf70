"""A supervised engine process: `jaxserve serve --engine-restarts N` replaces an engine process
that died (here: `kill -9`) with a new one that loads its steps from the compile cache, and exits
non-zero at the death after the N-th restart, for an orchestrator to take over."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
from server_helpers import STREAMS, Serve, streams_in_flight, wait_idle

ENDED_S = 2.0  # every request in flight ends this soon after the engine's death
BACK_S = 60.0


def kill_engine_while_streaming(serve: Serve) -> tuple[list, float]:
    """Kills the engine process under STREAMS streams; returns them and how long they took to end."""
    async def go():
        async with httpx.AsyncClient(base_url=serve.url, timeout=60) as client:
            streams = await streams_in_flight(client)
            serve.engine_process().kill()
            killed = time.monotonic()
            await asyncio.gather(*(s.task for s in streams))
            return streams, time.monotonic() - killed
    return asyncio.run(go())


def wait_health(serve: Serve, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(serve.url + "/health").status_code != status:
        assert time.monotonic() < deadline, f"/health never said {status}"
        time.sleep(0.1)


def test_a_killed_engine_process_is_replaced_once_and_the_next_death_exits_non_zero(checkpoints, tmp_path):
    serve = Serve(checkpoints("llama"), str(tmp_path / "serve.log"), args=("--engine-restarts", "1"))
    try:
        first_engine = serve.engine_process().pid
        streams, took = kill_engine_while_streaming(serve)
        assert took < ENDED_S
        for s in streams:
            assert s.events[-1] == "[DONE]"
            [error] = s.errors()
            assert "engine" in error["message"] and error["type"] == "server_error"
        refused = httpx.post(serve.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and "engine" in refused.json()["error"]["message"]

        wait_health(serve, 200, BACK_S)
        assert serve.engine_process().pid != first_engine
        r = httpx.post(serve.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        m = wait_idle(serve)
        assert m["jaxserve_engine_restarts_total"] == 1 and m["jaxserve_kv_pages_used"] == 0
        restarted = serve.output().split("starting a new engine process")[1]
        assert re.search(r"(\d+) step programs ready in [\d.]+ s: 0 compiled, \1 loaded from the compile cache",
                         restarted)

        serve.engine_process().kill()  # past the one restart allowed: the server gives up
        assert serve.proc.wait(30) != 0
        assert "past its 1 restarts" in serve.output()
    finally:
        serve.close()
    assert len(streams) == STREAMS
