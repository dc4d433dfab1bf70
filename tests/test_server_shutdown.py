"""Graceful shutdown of a real `jaxserve serve` (API process + engine process) on a tiny Llama.

On SIGTERM the streams in flight finish and a request arriving meanwhile gets 503; past
`--shutdown-timeout` (here after Ctrl+C, which signals the engine process too) the rest end with an
error event and [DONE]; a second signal stops at once. Every exit is 0 with no KV page held.
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
from server_helpers import LONG, STREAMS, Serve, streams_in_flight

EXIT_S = 30
STOPPED = "the engine stops with 0 KV pages held"


def test_sigterm_lets_the_streams_in_flight_finish_and_answers_new_requests_503(checkpoints, tmp_path):
    serve = Serve(checkpoints("llama"), str(tmp_path / "serve.log"))

    async def go():
        async with httpx.AsyncClient(base_url=serve.url, timeout=60) as client:
            streams = await streams_in_flight(client)
            serve.proc.send_signal(signal.SIGTERM)
            refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            finished_before_the_refusal = sum(s.done for s in streams)
            await asyncio.gather(*(s.task for s in streams))
            return refused, finished_before_the_refusal, streams
    try:
        refused, finished_before_the_refusal, streams = asyncio.run(go())
        assert serve.proc.wait(EXIT_S) == 0
    finally:
        serve.close()
    assert finished_before_the_refusal < STREAMS  # the refusal came during the drain
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    for s in streams:
        assert s.events[-1] == "[DONE]"
        assert s.finish_reasons()[-1] == "length" and not s.errors()
        assert s.chunks()[-1]["usage"]["completion_tokens"] == LONG
    assert STOPPED in serve.output()


def test_past_the_shutdown_timeout_streams_end_with_an_error_event(checkpoints, tmp_path):
    serve = Serve(checkpoints("llama"), str(tmp_path / "serve.log"), args=("--shutdown-timeout", "0.2"),
                  new_session=True)

    async def go():
        async with httpx.AsyncClient(base_url=serve.url, timeout=60) as client:
            streams = await streams_in_flight(client)
            os.killpg(serve.proc.pid, signal.SIGINT)  # Ctrl+C: the engine process hears it too
            await asyncio.gather(*(s.task for s in streams))
            return streams
    try:
        streams = asyncio.run(go())
        assert serve.proc.wait(EXIT_S) == 0
    finally:
        serve.close()
    for s in streams:
        assert s.events[-1] == "[DONE]"
        [error] = s.errors()
        assert "--shutdown-timeout 0.2 s" in error["message"] and error["type"] == "server_error"
        assert set(s.finish_reasons()) == {None}
    assert STOPPED in serve.output()


def test_a_second_signal_stops_at_once(checkpoints, tmp_path):
    serve = Serve(checkpoints("llama"), str(tmp_path / "serve.log"))

    async def go():
        async with httpx.AsyncClient(base_url=serve.url, timeout=60) as client:
            streams = await streams_in_flight(client)
            serve.proc.send_signal(signal.SIGTERM)
            # Two signals sent at once may arrive as one: the second goes once the first is seen.
            refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503
            serve.proc.send_signal(signal.SIGTERM)
            await asyncio.gather(*(s.task for s in streams))
            return streams
    try:
        streams = asyncio.run(go())
        assert serve.proc.wait(EXIT_S) == 0
    finally:
        serve.close()
    for s in streams:
        assert s.events[-1] == "[DONE]"
        [error] = s.errors()
        assert "stopped before this request finished" in error["message"]
        assert set(s.finish_reasons()) == {None}
    assert STOPPED in serve.output()
