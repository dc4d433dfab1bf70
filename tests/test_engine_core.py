"""The engine core's loop over a scripted stand-in engine: when requests finish, the loop waits a
moment for their clients' next requests, so that a closed-loop client's successor joins the very
next step (as it does in-process) instead of the one after."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import types

from jaxserve.engine.batching import FinishReason, SamplingParams
from jaxserve.entrypoints.engine_client import EngineClient

STEP_S = 0.1  # each stand-in step takes this long; the refill wait is half of it with async scheduling


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: str
    steps_left: int
    params: SamplingParams
    arrival_time: float
    output_token_ids: list = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_cached_tokens: int | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _ScriptedEngine:
    """Each request makes one token per step and finishes after `max_tokens` steps; every call is
    logged in order."""

    model_name, max_model_len, tokenizer, idle = "scripted", 64, None, False

    def __init__(self, async_scheduling: bool):
        self.config = types.SimpleNamespace(overlaps_steps=async_scheduling)
        self.requests: dict[str, _Request] = {}
        self.log: list[tuple] = []

    def add_request(self, prompt, params, request_id=None, group=None, arrival_time=None, cache_salt=None):
        self.requests[request_id] = _Request(request_id, params.max_tokens, params, arrival_time)
        self.log.append(("add", request_id))

    def has_unfinished(self):
        return any(not r.finished for r in self.requests.values())

    def step(self):
        time.sleep(STEP_S)
        running = [r for r in self.requests.values() if not r.finished]
        finished = []
        for r in running:
            r.output_token_ids.append(1)
            r.steps_left -= 1
            if r.steps_left == 0:
                r.finish_reason = FinishReason.LENGTH
                finished.append(r)
        self.log.append(("step", sorted(r.request_id for r in running)))
        return finished

    def request(self, request_id):
        return self.requests[request_id]

    def abort(self, request_id):
        r = self.requests.get(request_id)
        if r is not None and not r.finished:
            r.finish_reason = FinishReason.ABORT

    def release(self, request_id):
        pass

    def stats(self):
        return dict(running=sum(not r.finished for r in self.requests.values()), waiting=0, free_pages=1,
                    cached_pages=0, used_pages=0, total_pages=1)


async def _closed_loop_turn(client: EngineClient) -> None:
    """A long request keeps the engine busy; a short one finishes, and its successor is sent the
    moment the finish arrives."""
    await client.submit([[1]], [SamplingParams(max_tokens=8)], "long")
    _, short = await client.submit([[1]], [SamplingParams(max_tokens=2)], "short")
    while not any(d.finish_reason for d in await short.get()):
        pass
    _, successor = await client.submit([[1]], [SamplingParams(max_tokens=1)], "next")
    while not any(d.finish_reason for d in await successor.get()):
        pass


def _steps_between_finish_and_add(log: list[tuple]) -> int:
    """Steps that ran after the short request's last step and before its successor was added."""
    last_short = max(i for i, entry in enumerate(log) if entry[0] == "step" and "short-0" in entry[1])
    added = log.index(("add", "next-0"))
    return sum(1 for entry in log[last_short + 1: added] if entry[0] == "step")


def test_successor_of_a_finished_request_joins_the_next_step():
    for async_scheduling in (True, False):
        engine = _ScriptedEngine(async_scheduling)
        client = EngineClient.in_thread(engine)
        try:
            asyncio.run(_closed_loop_turn(client))
        finally:
            client.stop()
        assert _steps_between_finish_and_add(engine.log) == 0, (async_scheduling, engine.log)
        # and the successor ran in the step right after the finish
        last_short = max(i for i, e in enumerate(engine.log) if e[0] == "step" and "short-0" in e[1])
        next_step = next(e for e in engine.log[last_short + 1:] if e[0] == "step")
        assert "next-0" in next_step[1]
