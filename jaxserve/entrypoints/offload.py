"""Request work that may take long on the CPU (rendering a chat template, tokenizing a prompt of
megabytes, decoding for echo) runs off the event loop, so one request cannot stall every stream
and `/health`: in a small thread pool, and within a time limit, past which that request fails
with a 400 (the thread finishes on its own; a request's own chat template renders in a worker
process, which is killed then: `template_sandbox`).
A large answer (its final text and logprobs gathered, then JSON-encoded) is built in a pool of
its own, with no limit: its tokens are already paid for, and a pool full of slow templates must
not hold it up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools

from jaxserve.entrypoints.protocol import ApiError

WORKERS = 4
TIME_LIMIT_S = 10.0  # a template that renders for longer fails its request

LARGE_ANSWER_TOKENS = 4096  # an answer of more output tokens is built off the loop

_pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="jaxserve-request")
_answers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxserve-answer")


async def off_loop(fn, *args, what: str = "the request's text", param: str | None = None):
    """fn(*args) in the pool; an ApiError 400 naming `what` when it takes over TIME_LIMIT_S."""
    future = asyncio.get_running_loop().run_in_executor(_pool, functools.partial(fn, *args))
    try:
        return await asyncio.wait_for(future, TIME_LIMIT_S)
    except asyncio.TimeoutError:
        raise over_time_limit(what, param) from None


def over_time_limit(what: str, param: str | None = None) -> ApiError:
    """The 400 of request work that ran past TIME_LIMIT_S."""
    return ApiError(400, f"{what} took over {TIME_LIMIT_S:g} s to process", param=param)


async def answer(build, num_tokens: int):
    """build(), an answer of `num_tokens` output tokens: off the loop when it is large."""
    if num_tokens <= LARGE_ANSWER_TOKENS:
        return build()
    return await asyncio.get_running_loop().run_in_executor(_answers, build)
