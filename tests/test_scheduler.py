"""Scheduler and batching policies with a fake runner and an injectable clock: exact schedules,
in milliseconds, without jax."""

import subprocess
import sys

import numpy as np
import pytest

from jaxserve.batching import (BlockManager, Request, SamplingParams, Scheduler, SchedulerConfig, make_policy)

EOS = 0


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(strategy="paged", num_pages=9, page_size=4, max_slots=4, max_model_len=16, **policy):
    clock = Clock()
    blocks = BlockManager(num_pages, page_size)
    sched = Scheduler(SchedulerConfig(max_slots=max_slots, max_model_len=max_model_len, eos_token_ids=(EOS,)),
                      blocks, make_policy(strategy, **policy), clock)
    return sched, blocks, clock


def req(rid, length, max_tokens=4, group=0, arrival=0.0, **params):
    return Request(rid, list(range(1, length + 1)), SamplingParams(max_tokens=max_tokens, **params), seed=0,
                   arrival_time=arrival, group=group)


def run_step(sched):
    """One engine iteration with a fake runner whose next token is the last token + 1."""
    s = sched.schedule()
    reqs = s.decodes + s.prefills
    sched.update(reqs, np.array([r.all_token_ids[-1] + 1 for r in reqs]))
    return s


def ids(requests):
    return [r.request_id for r in requests]


def test_paged_admits_as_many_as_pages_allow():
    sched, blocks, _ = make(num_pages=9, page_size=4)  # 8 usable pages
    for rid, n in [("a", 5), ("b", 8), ("c", 4), ("d", 3)]:  # 2 + 2 + 1 + 1 pages
        sched.add(req(rid, n))
    s = sched.schedule()
    assert ids(s.prefills) == ["a", "b", "c", "d"] and s.decodes == []
    assert blocks.free_pages == 2
    assert [r.pages for r in s.prefills] == [[1, 2], [3, 4], [5], [6]]
    assert sched.table.block_tables[s.prefills[1].slot, :2].tolist() == [3, 4]


def test_paged_stops_admitting_when_pages_run_out():
    sched, blocks, _ = make(num_pages=5, page_size=4)  # 4 usable pages
    for rid, n in [("a", 8), ("b", 5), ("c", 1)]:
        sched.add(req(rid, n))
    s = sched.schedule()
    assert ids(s.prefills) == ["a", "b"] and ids(sched.waiting) == ["c"]  # FIFO: c waits behind b's pages


def test_growth_preempts_most_recent_and_recomputes():
    sched, blocks, _ = make(num_pages=5, page_size=4, max_slots=2)  # 4 usable pages
    sched.add(req("a", 4, max_tokens=8))
    sched.add(req("b", 4, max_tokens=8))
    run_step(sched)  # prefill both: 1 page each, 5 tokens each after sampling
    s = run_step(sched)  # each grows to a 2nd page for token 5
    assert ids(s.decodes) == ["a", "b"] and blocks.free_pages == 0
    for _ in range(4):
        s = run_step(sched)
    # a needs a 3rd page at 9 tokens: none free, so b (admitted last) is preempted.
    assert ids(s.preempted) == ["b"] and ids(s.decodes) == ["a"] and ids(sched.waiting) == ["b"]
    b = sched.waiting[0]
    assert b.pages == [] and b.num_preemptions == 1 and b.output_token_ids == [5, 6, 7, 8, 9]
    while sched.has_unfinished():
        run_step(sched)
    a_out = list(range(5, 13))
    assert b.output_token_ids == a_out  # resumed from its tokens, nothing lost
    assert blocks.free_pages == blocks.total_pages and sched.num_preemptions == 1


def test_continuous_reserves_the_full_context():
    sched, blocks, _ = make("continuous", num_pages=9, page_size=4, max_model_len=16)  # 4 pages per sequence
    for rid in "abc":
        sched.add(req(rid, 2))
    s = sched.schedule()
    assert ids(s.prefills) == ["a", "b"] and blocks.free_pages == 0


def test_continuous_admits_as_soon_as_a_slot_frees():
    sched, blocks, _ = make("continuous", num_pages=9, page_size=4, max_model_len=16)
    sched.add(req("a", 2, max_tokens=1))
    sched.add(req("b", 2, max_tokens=5))
    sched.add(req("c", 2, max_tokens=5))
    s = run_step(sched)  # a finishes at its first token
    assert ids(s.prefills) == ["a", "b"] and sched.waiting[0].request_id == "c"
    s = run_step(sched)
    assert ids(s.prefills) == ["c"] and ids(s.decodes) == ["b"]


def test_none_runs_one_at_a_time():
    sched, _, _ = make("none")
    sched.add(req("a", 2, max_tokens=2))
    sched.add(req("b", 2, max_tokens=2))
    steps = [(ids(s.prefills), ids(s.decodes)) for s in (run_step(sched) for _ in range(4))]
    assert steps == [(["a"], []), ([], ["a"]), (["b"], []), ([], ["b"])]


def test_static_never_admits_mid_batch():
    sched, _, _ = make("static")
    sched.add(req("a1", 2, max_tokens=1, group=1))
    sched.add(req("a2", 2, max_tokens=3, group=1))
    sched.add(req("b1", 2, max_tokens=1, group=2))
    s = run_step(sched)
    assert ids(s.prefills) == ["a1", "a2"]  # a1 finished, one slot is free ...
    s = run_step(sched)
    assert s.prefills == [] and ids(s.decodes) == ["a2"]  # ... but b1 does not join
    run_step(sched)
    s = run_step(sched)
    assert ids(s.prefills) == ["b1"]


def test_dynamic_closes_on_size():
    sched, _, clock = make("dynamic", batch_size=3, max_batch_delay_s=1.0)
    sched.add(req("a", 2))
    sched.add(req("b", 2))
    assert sched.schedule().empty  # 2 of 3, delay not reached
    sched.add(req("c", 2))
    sched.add(req("d", 2))
    assert ids(sched.schedule().prefills) == ["a", "b", "c"]


def test_dynamic_closes_on_delay():
    sched, _, clock = make("dynamic", batch_size=3, max_batch_delay_s=0.05)
    sched.add(req("a", 2, arrival=0.0))
    sched.add(req("b", 2, arrival=0.01))
    clock.now = 0.049
    assert sched.schedule().empty
    clock.now = 0.05
    assert ids(sched.schedule().prefills) == ["a", "b"]


def test_dynamic_runs_a_batch_to_completion_first():
    sched, _, clock = make("dynamic", batch_size=2, max_batch_delay_s=0.0)
    sched.add(req("a", 2, max_tokens=1))
    sched.add(req("b", 2, max_tokens=3))
    run_step(sched)
    sched.add(req("c", 2))
    s = run_step(sched)
    assert s.prefills == [] and ids(s.decodes) == ["b"]


def test_finish_reasons_and_pages_freed():
    sched, blocks, _ = make()
    sched.add(req("eos", 2, max_tokens=10))
    sched.add(req("len", 2, max_tokens=2))
    sched.add(req("stop", 2, max_tokens=10, stop_token_ids=(4,)))
    s = sched.schedule()
    finished = sched.update(s.prefills, np.array([EOS, 7, 4]))
    assert [(r.request_id, r.finish_reason.value) for r in finished] == [("eos", "stop"), ("stop", "stop")]
    s = sched.schedule()
    finished = sched.update(s.decodes, np.array([8]))
    assert [(r.request_id, r.finish_reason.value) for r in finished] == [("len", "length")]
    assert blocks.free_pages == blocks.total_pages and not sched.has_unfinished()


def test_ignore_eos_and_abort():
    sched, blocks, _ = make()
    sched.add(req("x", 2, max_tokens=10, ignore_eos=True))
    sched.add(req("w", 2))
    s = sched.schedule()
    sched.update(s.prefills[:1], np.array([EOS]))
    assert not s.prefills[0].finished
    assert sched.abort("x").finish_reason.value == "abort"
    assert sched.abort("w").finish_reason.value == "abort"
    assert sched.abort("unknown") is None
    assert blocks.free_pages == blocks.total_pages and not sched.has_unfinished()


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
    code = "import sys, jaxserve.batching; assert 'jax' not in sys.modules, 'batching imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True)
