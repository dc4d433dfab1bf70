"""The running requests' counters as arrays by slot (`slot_counters`): a busy scheduler, with
preemption, aborts (between steps, and between a step's schedule and its dispatch), prefix-cache
hits, sliding windows and steps that overlap (the next one scheduled and advanced before this
one's tokens arrive), against what each request must output.

A fake device samples the token at position p of request r as a fixed function of (r, p), EOS
now and then. So a request's output is known without any scheduler: that function from its
prompt's end until EOS, a stop id or max_tokens, however often it was preempted and recomputed.
The device takes each sequence's position from the step's inputs as the engine builds them, and
the decodes' tokens are checked against a fresh build from each request's own tokens."""

import numpy as np
import pytest

from jaxserve.engine.batching import BlockManager, Request, SamplingParams, Scheduler, SchedulerConfig, make_policy
from jaxserve.engine.batching.request import FinishReason

EOS, VOCAB = 2, 50


def token_at(request_id: str, position: int) -> int:
    """The fake device's token after `position` tokens of `request_id`: EOS about one time in 40."""
    h = (hash(request_id) * 1_000_003 + position * 7919) % 1_000_003
    return EOS if h % 40 == 0 else 3 + h % (VOCAB - 3)


def expected_output(request: Request) -> list[int]:
    out, stops = [], set(request.params.stop_token_ids) | {EOS}
    while len(out) < request.params.max_tokens:
        out.append(token_at(request.request_id, request.num_prompt_tokens + len(out)))
        if out[-1] in stops:
            break
    return out


def check_counters(sched: Scheduler) -> None:
    """What the arrays by slot must agree with, between any two calls."""
    counters = sched.counters
    assert len(set(counters.order.tolist())) == len(counters.order)  # each held slot once
    for request in sched.running:
        assert request.counters is counters and counters.requests[request.slot] is request
        if counters.decoding[request.slot] and not request.stopping:
            assert request.num_uncomputed_tokens == 1
    for request in sched.waiting:
        assert request.counters is None and request.slot is None


def step_inputs(sched: Scheduler, schedule) -> dict:
    """Each scheduled request's first position this step, from the step's inputs (the decodes'
    as arrays), with the decodes' tokens checked against a fresh build from their own tokens."""
    decodes = list(schedule.num_tokens)[:schedule.num_decodes]
    starts, last_tokens = sched.decode_inputs(schedule)
    fresh = [r.token_ids(r.num_computed_tokens, r.num_computed_tokens + 1)[0] for r in decodes]
    assert last_tokens.tolist() == fresh
    assert schedule.decode_slots.tolist() == [r.slot for r in decodes]
    positions = dict(zip(decodes, starts.tolist()))
    positions.update((r, r.num_computed_tokens) for r in list(schedule.num_tokens)[schedule.num_decodes:])
    return positions


def sampled(schedule, positions) -> np.ndarray:
    """The fake device's tokens: each sampling row's token after its last position this step."""
    return np.array([token_at(r.request_id, positions[r] + n) if r in schedule.sampling else 0
                     for r, n in schedule.num_tokens.items()], np.int32)


@pytest.mark.parametrize("windows", [(None,), (None, 8)], ids=["full", "sliding"])
@pytest.mark.parametrize("overlap", [False, True], ids=["in-order", "overlapped"])
def test_a_busy_scheduler_outputs_what_each_request_must(overlap, windows):
    rng = np.random.default_rng(7)
    blocks = BlockManager(24, 4, enable_caching=True, num_groups=len(windows))
    config = SchedulerConfig(max_slots=6, max_model_len=64, max_num_batched_tokens=24, eos_token_ids=(EOS,),
                             kv_group_windows=windows)
    sched = Scheduler(config, blocks, make_policy("paged"))
    shared = rng.integers(3, VOCAB, 12).tolist()  # a prefix some prompts share: prefix-cache hits
    requests, aborted, in_flight = [], set(), None
    for step in range(600):
        if len(requests) < 60 and rng.random() < 0.5:
            prompt = (shared[: rng.integers(4, 13)] if rng.random() < 0.5 else []) + \
                rng.integers(3, VOCAB, rng.integers(1, 14)).tolist()
            stops = (int(rng.integers(3, VOCAB)),) if rng.random() < 0.3 else ()
            requests.append(Request(f"r{len(requests)}", prompt, SamplingParams(
                max_tokens=int(rng.integers(1, 30)), stop_token_ids=stops), seed=0, arrival_time=0.0))
            sched.add(requests[-1])
        if sched.running and rng.random() < 0.03:  # an abort between steps, maybe of one in flight
            victim = sched.running[rng.integers(len(sched.running))]
            sched.abort(victim.request_id)
            aborted.add(victim.request_id)
        schedule = sched.schedule()
        check_counters(sched)
        launched = None
        if not schedule.empty:
            tokens = sampled(schedule, step_inputs(sched, schedule))
            if rng.random() < 0.05:  # one ends before its step is dispatched (as when its grammar's mask fails)
                victim = list(schedule.num_tokens)[rng.integers(len(schedule.num_tokens))]
                sched.finish(victim, FinishReason.ERROR)
                aborted.add(victim.request_id)
            sched.advance(schedule)
            check_counters(sched)
            launched = schedule, tokens
        if in_flight is not None:  # overlapped: the step before commits after this one is advanced
            sched.commit(*in_flight)
            check_counters(sched)
        in_flight = launched if overlap else None
        if launched is not None and not overlap:
            sched.commit(*launched)
            check_counters(sched)
        if not sched.has_unfinished() and in_flight is None and len(requests) >= 60:
            break
    assert not sched.has_unfinished() and in_flight is None, "the workload did not drain"
    assert sched.num_preemptions > 0 and sched.prefix_cache_hits > 0  # the test reached both
    for request in requests:
        assert request.finished and request.counters is None
        if request.request_id not in aborted:
            assert request.output_token_ids == expected_output(request), request.request_id
    assert blocks.used_pages == 0  # no page leaked
