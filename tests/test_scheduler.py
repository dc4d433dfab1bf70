"""Scheduler and batching policies with a fake runner and an injectable clock: exact schedules
({request: tokens this step}), in milliseconds, without jax."""

import subprocess
import sys

import numpy as np
import pytest

from jaxserve.engine.batching import (BlockManager, Request, SamplingParams, Scheduler, SchedulerConfig, make_policy)
from jaxserve.engine.batching.request import PENDING, FinishReason
from jaxserve.engine.batching.stop_ids import StopIds

EOS = 0


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(strategy="paged", num_pages=9, page_size=4, max_slots=4, max_model_len=16, budget=64, chunked=True,
         caching=False, **policy):
    """A scheduler over a fresh block manager. Prompts built by `req` share their leading tokens,
    so prefix caching is off unless a test is about it."""
    clock = Clock()
    blocks = BlockManager(num_pages, page_size, enable_caching=caching)
    config = SchedulerConfig(max_slots=max_slots, max_model_len=max_model_len, max_num_batched_tokens=budget,
                             enable_chunked_prefill=chunked, eos_token_ids=(EOS,))
    sched = Scheduler(config, blocks, make_policy(strategy, **policy), clock)
    return sched, blocks, clock


def req(rid, length, max_tokens=4, group=0, arrival=0.0, **params):
    return Request(rid, list(range(1, length + 1)), SamplingParams(max_tokens=max_tokens, **params), seed=0,
                   arrival_time=arrival, group=group)


def run_step(sched):
    """One engine iteration with a fake runner whose next token is the last token + 1."""
    s = sched.schedule()
    sched.update(s, np.array([(r.output_token_ids or r.prompt_token_ids)[-1] + 1 for r in s.num_tokens]))
    return s


def ids(requests):
    return [r.request_id for r in requests]


def tokens(s):
    """The schedule as {request id: tokens}, in schedule order."""
    return {r.request_id: n for r, n in s.num_tokens.items()}


def test_paged_admits_as_many_as_pages_allow():
    sched, blocks, _ = make(num_pages=9, page_size=4)  # 8 usable pages
    for rid, n in [("a", 5), ("b", 8), ("c", 4), ("d", 3)]:  # 2 + 2 + 1 + 1 pages
        sched.add(req(rid, n))
    s = sched.schedule()
    assert tokens(s) == {"a": 5, "b": 8, "c": 4, "d": 3} and ids(s.admitted) == ["a", "b", "c", "d"]
    assert blocks.free_pages == 2
    assert [r.pages for r in s.admitted] == [[[1, 2]], [[3, 4]], [[5]], [[6]]]  # one KV-cache group
    slot, group, index, page = sched.table.take_updates().T  # what the device's tables receive
    assert page[(slot == s.admitted[1].slot) & (group == 0) & (index < 2)].tolist() == [3, 4]


def test_paged_stops_admitting_when_pages_run_out():
    sched, blocks, _ = make(num_pages=5, page_size=4)  # 4 usable pages
    for rid, n in [("a", 8), ("b", 5), ("c", 1)]:
        sched.add(req(rid, n))
    s = sched.schedule()
    assert tokens(s) == {"a": 8, "b": 5} and ids(sched.waiting) == ["c"]  # FIFO: c waits behind b's pages


def test_growth_preempts_most_recent_and_recomputes():
    sched, blocks, _ = make(num_pages=5, page_size=4, max_slots=2)  # 4 usable pages
    sched.add(req("a", 4, max_tokens=8))
    sched.add(req("b", 4, max_tokens=8))
    run_step(sched)  # prefill both: 1 page each, 5 tokens each after sampling
    s = run_step(sched)  # each grows to a 2nd page for token 5
    assert tokens(s) == {"a": 1, "b": 1} and blocks.free_pages == 0
    for _ in range(4):
        s = run_step(sched)
    # a needs a 3rd page at 9 tokens: none free, so b (admitted last) is preempted.
    assert ids(s.preempted) == ["b"] and tokens(s) == {"a": 1} and ids(sched.waiting) == ["b"]
    b = sched.waiting[0]
    assert b.pages == [] and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.output_token_ids == [5, 6, 7, 8, 9]
    while sched.has_unfinished():
        run_step(sched)
    a_out = list(range(5, 13))
    assert b.output_token_ids == a_out  # resumed from its tokens, nothing lost
    assert blocks.free_pages == blocks.total_pages and sched.num_preemptions == 1


def test_budget_goes_to_decodes_first_then_chunks_a_long_prompt():
    sched, blocks, _ = make(num_pages=33, page_size=4, max_slots=4, max_model_len=64, budget=8)
    sched.add(req("a", 2, max_tokens=20))
    sched.add(req("b", 3, max_tokens=20))
    assert tokens(run_step(sched)) == {"a": 2, "b": 3}
    sched.add(req("c", 20, max_tokens=2))
    a, b = sched.running
    schedules = []
    while "c" not in [r.request_id for r in sched.running] or sched.running[2].num_uncomputed_tokens > 1:
        before = (a.num_tokens, b.num_tokens)
        schedules.append(tokens(run_step(sched)))
        assert (a.num_tokens, b.num_tokens) == (before[0] + 1, before[1] + 1)  # every step, a decode each
    assert schedules == [{"a": 1, "b": 1, "c": 6}, {"a": 1, "b": 1, "c": 6}, {"a": 1, "b": 1, "c": 6},
                         {"a": 1, "b": 1, "c": 2}]
    c = sched.running[2]
    assert c.output_token_ids == [21] and c.num_computed_tokens == 20
    assert tokens(run_step(sched)) == {"a": 1, "b": 1, "c": 1}


@pytest.mark.parametrize("chunked,expected", [
    (True, [{"a": 1, "b": 1, "c": 20, "d": 2}, {"a": 1, "b": 1, "c": 1, "d": 8}]),
    (False, [{"a": 1, "b": 1, "c": 20}, {"a": 1, "b": 1, "c": 1, "d": 10}]),
])
def test_without_chunking_a_prompt_runs_whole(chunked, expected):
    sched, _, _ = make(num_pages=33, page_size=4, max_slots=4, max_model_len=64, budget=24, chunked=chunked)
    sched.add(req("a", 2, max_tokens=20))
    sched.add(req("b", 3, max_tokens=20))
    run_step(sched)
    sched.add(req("c", 20))
    sched.add(req("d", 10))
    assert [tokens(run_step(sched)) for _ in expected] == expected


def test_preemption_in_the_middle_of_a_prefill_frees_its_pages():
    sched, blocks, _ = make(num_pages=8, page_size=4, max_slots=2, max_model_len=32, budget=8)  # 7 usable
    sched.add(req("a", 4, max_tokens=8))
    sched.add(req("b", 24, max_tokens=4))
    assert tokens(run_step(sched)) == {"a": 4, "b": 4} and blocks.free_pages == 0  # 1 + 6 pages
    b = sched.running[1]
    s = run_step(sched)  # a's 5th token needs a 2nd page: b, mid-prefill, gives its pages back
    assert ids(s.preempted) == ["b"] and tokens(s) == {"a": 1}
    assert b.pages == [] and b.num_computed_tokens == 0 and ids(sched.waiting) == ["b"] and blocks.free_pages == 5
    steps = []
    while sched.has_unfinished():
        steps.append(tokens(run_step(sched)))
    # b waits for a's last 6 decodes (it needs 6 pages), then prefills again from its first token.
    assert steps == [{"a": 1}] * 6 + [{"b": 8}, {"b": 8}, {"b": 8}, {"b": 1}, {"b": 1}, {"b": 1}]
    assert b.output_token_ids == [25, 26, 27, 28] and b.finish_reason.value == "length"
    assert blocks.free_pages == blocks.total_pages


def test_abort_in_the_middle_of_a_prefill_frees_its_pages():
    sched, blocks, _ = make(num_pages=33, page_size=4, max_slots=2, max_model_len=32, budget=8)
    sched.add(req("a", 2, max_tokens=10))
    sched.add(req("b", 24))
    assert tokens(run_step(sched)) == {"a": 2, "b": 6}
    b = sched.abort("b")
    assert b.finish_reason.value == "abort" and b.pages == [] and ids(sched.running) == ["a"]
    assert blocks.free_pages == blocks.total_pages - 1  # only a's page
    assert tokens(run_step(sched)) == {"a": 1}


def test_continuous_reserves_the_full_context():
    sched, blocks, _ = make("continuous", num_pages=9, page_size=4, max_model_len=16)  # 4 pages per sequence
    for rid in "abc":
        sched.add(req(rid, 2))
    s = sched.schedule()
    assert tokens(s) == {"a": 2, "b": 2} and blocks.free_pages == 0


def test_continuous_admits_as_soon_as_a_slot_frees():
    sched, blocks, _ = make("continuous", num_pages=9, page_size=4, max_model_len=16)
    sched.add(req("a", 2, max_tokens=1))
    sched.add(req("b", 2, max_tokens=5))
    sched.add(req("c", 2, max_tokens=5))
    s = run_step(sched)  # a finishes at its first token
    assert tokens(s) == {"a": 2, "b": 2} and sched.waiting[0].request_id == "c"
    assert tokens(run_step(sched)) == {"b": 1, "c": 2}


def test_none_runs_one_at_a_time():
    sched, _, _ = make("none")
    sched.add(req("a", 2, max_tokens=2))
    sched.add(req("b", 2, max_tokens=2))
    assert [tokens(run_step(sched)) for _ in range(4)] == [{"a": 2}, {"a": 1}, {"b": 2}, {"b": 1}]


def test_static_never_admits_mid_batch():
    sched, _, _ = make("static")
    sched.add(req("a1", 2, max_tokens=1, group=1))
    sched.add(req("a2", 2, max_tokens=3, group=1))
    sched.add(req("b1", 2, max_tokens=1, group=2))
    # a1 finishes at once and frees a slot, but b1 waits for the whole payload.
    assert [tokens(run_step(sched)) for _ in range(4)] == [{"a1": 2, "a2": 2}, {"a2": 1}, {"a2": 1}, {"b1": 2}]


def test_static_admits_a_whole_payload_even_when_the_budget_is_small():
    sched, _, _ = make("static", num_pages=33, max_model_len=32, budget=8)
    for rid in ("p1", "p2", "p3"):
        sched.add(req(rid, 10, max_tokens=2, group=1))
    sched.add(req("q", 2, group=2))
    s = run_step(sched)
    assert ids(s.admitted) == ["p1", "p2", "p3"] and tokens(s) == {"p1": 8}  # admitted together, run by budget
    assert [tokens(run_step(sched)) for _ in range(4)] == [
        {"p1": 2, "p2": 6}, {"p1": 1, "p2": 4, "p3": 3}, {"p2": 1, "p3": 7}, {"p3": 1}]
    assert ids(sched.waiting) == ["q"] and tokens(run_step(sched)) == {"q": 2}


def test_dynamic_closes_on_size():
    sched, _, clock = make("dynamic", batch_size=3, max_batch_delay_s=1.0)
    sched.add(req("a", 2))
    sched.add(req("b", 2))
    assert sched.schedule().empty  # 2 of 3, delay not reached
    sched.add(req("c", 2))
    sched.add(req("d", 2))
    assert tokens(sched.schedule()) == {"a": 2, "b": 2, "c": 2}


def test_dynamic_closes_on_delay():
    sched, _, clock = make("dynamic", batch_size=3, max_batch_delay_s=0.05)
    sched.add(req("a", 2, arrival=0.0))
    sched.add(req("b", 2, arrival=0.01))
    clock.now = 0.049
    assert sched.schedule().empty
    clock.now = 0.05
    assert tokens(sched.schedule()) == {"a": 2, "b": 2}


def test_dynamic_runs_a_batch_to_completion_first():
    sched, _, clock = make("dynamic", batch_size=2, max_batch_delay_s=0.0)
    sched.add(req("a", 2, max_tokens=1))
    sched.add(req("b", 2, max_tokens=3))
    run_step(sched)
    sched.add(req("c", 2))
    assert tokens(run_step(sched)) == {"b": 1}


def test_finish_reasons_and_pages_freed():
    sched, blocks, _ = make()
    sched.add(req("eos", 2, max_tokens=10))
    sched.add(req("len", 2, max_tokens=2))
    sched.add(req("stop", 2, max_tokens=10, stop_token_ids=(4,)))
    s = sched.schedule()
    finished = sched.update(s, np.array([EOS, 7, 4]))
    assert [(r.request_id, r.finish_reason.value) for r in finished] == [("eos", "stop"), ("stop", "stop")]
    s = sched.schedule()
    finished = sched.update(s, np.array([8]))
    assert [(r.request_id, r.finish_reason.value) for r in finished] == [("len", "length")]
    assert blocks.free_pages == blocks.total_pages and not sched.has_unfinished()


def test_a_stop_id_ends_only_the_requests_it_belongs_to():
    """`commit` looks closely only at tokens that end some request: another request's stop id, or
    EOS under ignore_eos, goes on; a finished request's stop ids end no one any more."""
    sched, blocks, _ = make(max_slots=3)
    sched.add(req("a", 2, max_tokens=10, stop_token_ids=(4,)))
    sched.add(req("b", 2, max_tokens=10, ignore_eos=True, stop_token_ids=tuple(range(20, 40))))  # more than 8
    sched.add(req("c", 2, max_tokens=10))
    finished = sched.update(sched.schedule(), np.array([4, EOS, 30]))  # a's stop; EOS for b; b's stop for c
    assert ids(finished) == ["a"]
    finished = sched.update(sched.schedule(), np.array([4, 4]))  # a's stop id, a gone: b and c go on
    assert finished == []
    finished = sched.update(sched.schedule(), np.array([39, EOS]))
    assert ids(finished) == ["b", "c"] and [r.finish_reason.value for r in finished] == ["stop", "stop"]
    assert [r.output_token_ids for r in finished] == [[EOS, 4, 39], [30, 4, EOS]]
    assert blocks.free_pages == blocks.total_pages


def test_stop_ids_among_marks_exactly_the_ids_of_unfinished_requests():
    stops = StopIds(eos_token_ids=(EOS,))
    a, b = req("a", 2, stop_token_ids=(7, 262_143)), req("b", 2, ignore_eos=True, stop_token_ids=(5,))
    stops.add(a)
    stops.add(b)
    tokens = np.array([[0, 5, 7, 6, 8, 262_143, 262_142, 300_000]])
    assert stops.among(tokens).tolist() == [[True, True, True, False, False, True, False, False]]
    stops.remove(a)  # b ignores EOS: only 5 is left
    assert stops.among(tokens).tolist() == [[False, True] + [False] * 6]
    stops.remove(b)
    assert not stops.among(tokens).any()


def test_a_page_filled_while_its_last_token_is_on_the_device_is_cached_at_the_next_commit():
    """Steps overlapping: the decode that fills page 0 runs before the token it computes (the
    prompt's sampled one) reaches the host, so the page is recorded in the prefix cache when it does."""
    sched, _, _ = make(caching=True)
    sched.add(req("a", 3, max_tokens=6))
    prefill = sched.schedule()
    sched.advance(prefill)
    decode = sched.schedule()
    sched.advance(decode)  # computed 4 tokens: page 0 is full, its last token still pending
    a = prefill.admitted[0]
    probe = Request("b", [1, 2, 3, 10, 11], SamplingParams(), seed=0, arrival_time=0.0)
    assert a.num_cached_pages == 0 and sched.prefix.hits(probe)[0] == 0
    sched.commit(prefill, np.array([10]))
    assert a.num_cached_pages == 1 and sched.prefix.hits(probe)[0] == 1


def test_a_page_recorded_at_commit_is_forgotten_with_the_step_that_computed_it():
    """The page recorded when its last token reached the host belongs to the step that computed
    that token's K/V (the decode still in flight): if that step fails, forgetting its pages drops
    this one too. A request that took a forgotten page as a hit meanwhile is sent back to be
    recomputed (it has run nothing); one with a token on the device ends with error."""
    sched, blocks, _ = make(caching=True)
    sched.add(req("a", 3, max_tokens=6))
    prefill = sched.schedule()
    sched.advance(prefill)
    decode = sched.schedule()
    sched.advance(decode)
    sched.commit(prefill, np.array([10]))  # page 0 recorded now, computed by `decode`
    a = prefill.admitted[0]
    assert decode.cached_pages == a.pages[0][:1] and prefill.cached_pages == []
    hit = Request("b", [1, 2, 3, 10, 11], SamplingParams(), seed=0, arrival_time=0.0)
    sched.add(hit)
    after = sched.schedule()  # b admitted on page 0; a decodes again (its token on the device)
    assert hit.num_computed_tokens == 4 and tokens(after) == {"a": 1, "b": 1}
    sched.advance(after)
    sched.finish(a, FinishReason.ERROR)  # `decode` failed: its requests end
    assert sched.forget(decode.cached_pages) == [hit]  # b sampled in `after`: its token is lost
    assert hit.finish_reason is FinishReason.ERROR and sched.prefix.hits(hit)[0] == 0
    assert blocks.free_pages == blocks.total_pages and not sched.has_unfinished()


def test_forget_sends_back_a_request_that_ran_nothing_on_a_forgotten_page():
    sched, blocks, _ = make(caching=True, budget=8)
    sched.add(req("a", 16))  # four pages: two chunks of the budget
    first = sched.schedule()
    sched.advance(first)  # pages 0 and 1 recorded
    b = Request("b", list(range(1, 9)) + [50, 51], SamplingParams(max_tokens=2), seed=0, arrival_time=0.0)
    sched.add(b)
    second = sched.schedule()  # a's second chunk takes the budget; b is admitted on two pages, runs nothing
    assert b in second.admitted and b not in second.num_tokens and b.num_computed_tokens == 8
    sched.advance(second)
    a = first.admitted[0]
    sched.finish(a, FinishReason.ERROR)
    assert sched.forget(first.cached_pages + second.cached_pages) == []
    assert ids(sched.waiting) == ["b"] and b.num_computed_tokens == 0 and b.num_preemptions == 1
    while sched.has_unfinished():
        run_step(sched)
    assert b.finish_reason is FinishReason.LENGTH and blocks.used_pages == 0


def test_a_failure_outside_any_requests_part_of_schedule_ends_the_newly_admitted(monkeypatch):
    """Nothing says whose it was: the requests admitted by that schedule end with error and the
    running ones go on; with none admitted, the running ones end (a repeating fault cannot stall
    the engine). The policy raising ends the queue's head, whose admission it was deciding."""
    sched, blocks, _ = make(budget=16)
    sched.add(req("old", 3, max_tokens=8))
    run_step(sched)
    sched.add(req("new", 3))
    real, calls = Scheduler._fill_budget, []

    def fill_budget(self, *args):
        calls.append(1)
        if len(calls) in (1, 3):
            raise RuntimeError("a bug filling the budget")
        return real(self, *args)
    monkeypatch.setattr(Scheduler, "_fill_budget", fill_budget)
    s = sched.schedule()
    assert s.empty and ids(s.failed) == ["new"] and ids(sched.running) == ["old"]
    assert [r.finish_reason for r in s.failed] == [FinishReason.ERROR]
    assert tokens(run_step(sched)) == {"old": 1}  # the next step runs as usual
    s = sched.schedule()
    assert ids(s.failed) == ["old"] and not sched.has_unfinished()
    monkeypatch.setattr(type(sched.policy), "admissible", lambda *args: 1 // 0)
    sched.add(req("head", 2))
    sched.add(req("next", 2))
    s = sched.schedule()
    assert ids(s.failed) == ["head"] and ids(sched.waiting) == ["next"]
    assert blocks.free_pages == blocks.total_pages


def test_a_chunk_that_does_not_finish_the_prompt_samples_nothing():
    sched, _, _ = make(num_pages=33, max_model_len=32, budget=4)
    sched.add(req("a", 6))
    s = sched.schedule()
    assert tokens(s) == {"a": 4} and not s.samples(s.admitted[0])
    sched.update(s, np.array([EOS]))  # whatever the runner sampled for a chunk is dropped
    a = sched.running[0]
    assert a.output_token_ids == [] and a.num_computed_tokens == 4 and not a.finished


def test_ignore_eos_and_abort():
    sched, blocks, _ = make()
    sched.add(req("x", 2, max_tokens=10, ignore_eos=True))
    sched.add(req("w", 2))
    s = sched.schedule()
    sched.update(s, np.array([EOS, 5]))
    assert not s.admitted[0].finished and s.admitted[0].output_token_ids == [EOS]
    assert sched.abort("x").finish_reason.value == "abort"
    assert sched.abort("w").finish_reason.value == "abort"
    assert sched.abort("unknown") is None
    assert blocks.free_pages == blocks.total_pages and not sched.has_unfinished()


def test_budget_below_max_slots_is_refused():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_slots=8, max_model_len=16, max_num_batched_tokens=4)


def test_block_manager_ref_counts():
    blocks = BlockManager(4, 16)
    pages = blocks.allocate(2)
    assert pages == [1, 2] and blocks.free_pages == 1
    blocks.share(pages)
    blocks.free(pages)
    assert blocks.free_pages == 1
    blocks.free(pages)
    assert blocks.free_pages == 3
    with pytest.raises(RuntimeError):
        blocks.free([1])
    with pytest.raises(RuntimeError):
        blocks.allocate(4)
    with pytest.raises(ValueError):
        BlockManager(1, 16)


def test_batching_does_not_import_jax():
    code = "import sys, jaxserve.engine.batching; assert 'jax' not in sys.modules, 'batching imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_next_step_is_scheduled_before_this_ones_tokens_arrive():
    sched, blocks, _ = make(num_pages=33, max_model_len=32)
    sched.add(req("a", 3, max_tokens=3))
    sched.add(req("b", 2, max_tokens=10))
    first = sched.schedule()
    sched.advance(first)  # dispatched: a and b each hold a pending token
    a, b = sched.running
    assert a.num_tokens == 4 and a.output_token_ids == [] and a.token_ids(2, 4) == [3, PENDING]
    second = sched.schedule()  # scheduled while the first step still runs
    assert tokens(second) == {"a": 1, "b": 1}
    sched.advance(second)
    assert sched.commit(first, np.array([7, EOS])) == [b]  # b ended on EOS: its second token is dropped
    assert b.output_token_ids == [EOS] and b.finish_reason.value == "stop" and b.num_pending_tokens == 0
    third = sched.schedule()
    assert tokens(third) == {"a": 1}
    sched.advance(third)
    assert a.stopping  # a's 3rd token is pending and will be its last
    assert tokens(sched.schedule()) == {}  # nothing left to run while a's last token is in flight
    assert sched.commit(second, np.array([8, 99])) == [] and a.output_token_ids == [7, 8]
    assert sched.commit(third, np.array([9])) == [a] and a.finish_reason.value == "length"
    assert a.output_token_ids == [7, 8, 9] and blocks.free_pages == blocks.total_pages
