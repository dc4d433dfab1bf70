"""WorkerProcesses: work run in a process of its own, its errors told, and killed past its time;
and the check of a request's constraint, which runs in one."""

import asyncio
import os
import time

import pytest

from jaxserve.entrypoints import constraints
from jaxserve.entrypoints.protocol import ApiError, CompletionRequest
from jaxserve.entrypoints.worker_processes import WorkerProcesses


@pytest.fixture(scope="module")
def workers():
    return WorkerProcesses(1, "jaxserve-test-worker")


def test_a_call_returns_what_the_function_returned_in_another_process(workers):
    assert workers.call(divmod, (17, 5), timeout=30) == (3, 2)
    assert workers.call(os.getpid, (), timeout=30) != os.getpid()


def test_a_function_that_raises_is_a_value_error_with_its_message_and_the_worker_stays(workers):
    pid = workers.call(os.getpid, (), timeout=30)
    with pytest.raises(ValueError, match="invalid literal for int"):
        workers.call(int, ("seven",), timeout=30)
    assert workers.call(os.getpid, (), timeout=30) == pid


def test_a_call_past_its_time_kills_the_worker_and_the_next_call_gets_a_new_one(workers):
    pid = workers.call(os.getpid, (), timeout=30)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="sleeping ran for over 0.5 s"):
        workers.call(time.sleep, (30,), timeout=0.5, what="sleeping")
    assert time.monotonic() - start < 10
    assert workers.killed == 1
    assert workers.call(os.getpid, (), timeout=30) != pid


def test_a_worker_that_dies_fails_its_call_alone(workers):
    with pytest.raises(ValueError, match="the worker process died during exiting"):
        workers.call(os._exit, (3,), timeout=30, what="exiting")
    assert workers.call(divmod, (9, 4), timeout=30) == (2, 1)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})


def test_the_constraint_checked_in_a_worker_is_the_one_checked_here(monkeypatch):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(50)}}
    body = completion(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    here, _ = constraints.constraint(body, chat=False)
    monkeypatch.setattr(constraints, "constraint", lambda *a, **k: pytest.fail("checked in the API process"))
    there, tools = asyncio.run(constraints.checked_constraint(body, chat=False))
    assert (there, there.llguidance_grammar, tools) == (here, here.llguidance_grammar, None)


def test_a_constraint_refused_in_a_worker_keeps_its_status_and_param():
    with pytest.raises(ApiError) as refused:
        asyncio.run(constraints.checked_constraint(completion(structured_outputs={"regex": "(("}), chat=False))
    assert (refused.value.status, refused.value.param, refused.value.type) == (
        400, "structured_outputs.regex", "invalid_request_error")
    assert "invalid regex" in refused.value.message
