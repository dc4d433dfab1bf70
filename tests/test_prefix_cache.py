"""Prefix caching without jax: chained page hashes, salts, the exact LRU eviction order, hits at
admission, a shared prefix computed once, preemption and abort while pages are shared, a lost
pool (every hash dropped, the running recomputed), and the page accounting when idle (free +
cached == all, no reference left)."""

import numpy as np

from jaxserve.engine.batching import BlockManager, Request, SamplingParams, Scheduler, SchedulerConfig, make_policy
from jaxserve.engine.batching.page_hash import ROOT, hash_page

P = 4  # page size


def make(strategy="paged", num_pages=33, max_slots=4, max_model_len=64, budget=64):
    blocks = BlockManager(num_pages, P)
    config = SchedulerConfig(max_slots=max_slots, max_model_len=max_model_len, max_num_batched_tokens=budget)
    return Scheduler(config, blocks, make_policy(strategy)), blocks


def req(rid, tokens, max_tokens=2, salt=None, group=0):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), seed=0, arrival_time=0.0,
                   group=group, cache_salt=salt)


def run_step(sched):
    s = sched.schedule()
    sched.update(s, np.array([100 + r.num_tokens for r in s.num_tokens]))
    return {r.request_id: n for r, n in s.num_tokens.items()}


def run_all(sched):
    steps = []
    while sched.has_unfinished():
        steps.append(run_step(sched))
    return steps


def assert_idle(blocks):
    assert blocks.used_pages == 0 and blocks.free_pages + blocks.cached_pages == blocks.total_pages
    assert all(r == 0 for r in blocks._refs)


# ---- hashing ----

def test_hashes_chain_and_salts_separate():
    first, other_first = hash_page(ROOT, [1, 2, 3, 4], None), hash_page(ROOT, [9, 2, 3, 4], None)
    assert hash_page(first, [5, 6, 7, 8], None) != hash_page(other_first, [5, 6, 7, 8], None)  # the chain
    assert hash_page(ROOT, [1, 2, 3, 4], "tenant-a") != hash_page(ROOT, [1, 2, 3, 4], "tenant-b") != first
    assert hash_page(ROOT, [1, 2, 3, 4], None) == first and len(first) == 32  # SHA-256


def test_only_full_computed_pages_get_a_hash():
    sched, blocks = make()
    sched.add(req("a", range(1, 11), max_tokens=1))  # 2 full pages and a partial one
    run_all(sched)
    assert blocks.cached_pages == 2 and blocks.free_pages == blocks.total_pages - 2
    assert len(blocks._page_of) == 2


# ---- eviction ----

def test_exact_lru_eviction_order_tail_first():
    blocks = BlockManager(8, P)  # 7 usable pages
    a, b = blocks.allocate(3), blocks.allocate(2)  # [1, 2, 3], [4, 5]
    hashes = {p: bytes([p]) * 32 for p in a + b}
    for p in a + b:
        blocks.cache(p, hashes[p])
    blocks.free(reversed(a))  # a's chain returns tail first: 3, 2, 1
    blocks.free(reversed(b))  # then b's: 5, 4
    assert (blocks.free_pages, blocks.cached_pages, blocks.used_pages) == (2, 5, 0)
    assert blocks.allocate(2) == [6, 7]  # free pages first
    evicted = [blocks.allocate(1)[0] for _ in range(5)]
    assert evicted == [3, 2, 1, 5, 4]  # least recently used first, each chain's tail before its head
    assert blocks.lookup([hashes[1]]) == [] and not blocks._hash_of  # evicted pages lost their hashes


def test_a_hit_leaves_the_evictable_set_and_refreshes_nothing_else():
    blocks = BlockManager(5, P)  # 4 usable
    pages = blocks.allocate(4)
    for p in pages:
        blocks.cache(p, bytes([p]) * 32)
    blocks.free(pages)  # LRU: 1, 2, 3, 4
    blocks.share([1])  # a hit on the oldest
    assert blocks.cached_pages == 3 and blocks.used_pages == 1
    assert not blocks.can_allocate(4) and blocks.can_allocate(3)
    assert not blocks.can_allocate(3, keeping=[2])  # page 2 is about to be shared: not evictable
    assert blocks.allocate(2) == [2, 3]
    blocks.free([1])
    assert blocks.allocate(2) == [4, 1]  # 1 went back to the most recent end


def test_a_page_hit_by_an_admission_is_never_evicted_for_it():
    sched, blocks = make(num_pages=6, max_model_len=32)  # 5 usable pages
    sched.add(req("a", range(1, 13), max_tokens=1))  # pages 1, 2, 3, all full
    run_all(sched)
    sched.add(req("x", range(50, 58), max_tokens=1))  # pages 4, 5
    run_all(sched)
    assert blocks.free_pages == 0 and blocks.cached_pages == 5  # LRU: 3, 2, 1, 5, 4
    b = req("b", list(range(1, 9)) + [77, 78, 79, 80, 81], max_tokens=2)  # a's first 2 pages, then 2 new ones
    sched.add(b)
    assert run_step(sched) == {"b": 5}
    assert b.pages == [[1, 2, 3, 5]]  # the hits 1 and 2 were the 2nd and 3rd oldest: 3 and 5 were evicted instead
    assert blocks.lookup(b.page_hashes[:2]) == [1, 2] and blocks.lookup([hash_page(ROOT, [50, 51, 52, 53], None)]) == [4]


def test_a_reset_forgets_every_hash_cached_or_in_use():
    blocks = BlockManager(5, P)  # 4 usable
    pages = blocks.allocate(2)
    for p in pages:
        blocks.cache(p, bytes([p]) * 32)
    blocks.free(pages[:1])  # one cached, one still read
    blocks.reset_prefix_cache()
    assert (blocks.free_pages, blocks.cached_pages, blocks.used_pages) == (3, 0, 1)
    blocks.free(pages[1:])
    assert blocks.free_pages == 4 and blocks.lookup([bytes([p]) * 32 for p in pages]) == []


# ---- the scheduler ----

def test_admission_starts_after_the_cached_pages_and_counts_queries_and_hits():
    sched, blocks = make()
    sched.add(req("a", range(1, 13), max_tokens=1))
    assert run_all(sched) == [{"a": 12}]
    sched.add(req("b", list(range(1, 9)) + [40, 41, 42]))  # a's first 2 pages, then its own tokens
    assert run_step(sched) == {"b": 3}
    b = sched.running[0]
    assert b.num_cached_tokens == 8 and b.pages[0][:2] == [1, 2]
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (12 + 11, 8)


def test_the_last_prompt_token_is_always_computed():
    sched, blocks = make()
    sched.add(req("a", range(1, 13), max_tokens=1))
    run_all(sched)
    sched.add(req("same", range(1, 13), max_tokens=1))  # all 3 pages cached, but the last token must run
    assert run_step(sched) == {"same": 4}  # page 3 recomputed into a page of its own
    assert sched.prefix_cache_hits == 8


def test_different_salts_never_share():
    sched, blocks = make()
    sched.add(req("a", range(1, 13), max_tokens=1, salt="tenant-a"))
    sched.add(req("b", range(1, 13), max_tokens=1, salt="tenant-b"))  # not held back either
    assert run_step(sched) == {"a": 12, "b": 12}
    sched.add(req("c", range(1, 13), max_tokens=1, salt="tenant-b"))
    run_all(sched)
    assert sched.prefix_cache_hits == 8  # c found b's pages, never a's


def test_a_shared_prefix_arriving_together_is_computed_once():
    sched, blocks = make(budget=8)
    prefix = list(range(1, 13))
    for i in range(3):
        sched.add(req(f"r{i}", prefix + [50 + i, 60 + i], max_tokens=2))
    steps = run_all(sched)
    # r1 and r2 wait while r0 computes the 3 shared pages, then take them from the cache.
    assert steps == [{"r0": 8}, {"r0": 6}, {"r0": 1, "r1": 2, "r2": 2}, {"r1": 1, "r2": 1}]
    assert sched.prefix_cache_hits == 24
    assert_idle(blocks)


def test_static_batches_do_not_wait_for_a_shared_prefix():
    sched, blocks = make("static", budget=64)
    for i in range(2):
        sched.add(req(f"r{i}", list(range(1, 13)) + [50 + i], group=1))
    assert run_step(sched) == {"r0": 13, "r1": 13}  # the payload starts together, as static promises


def test_preemption_and_abort_while_pages_are_shared():
    sched, blocks = make(num_pages=9, max_slots=3, max_model_len=32, budget=32)  # 8 usable pages
    prefix = list(range(1, 9))
    sched.add(req("a", prefix + [20, 21], max_tokens=10))  # 3 pages
    run_step(sched)
    sched.add(req("b", prefix + [30, 31], max_tokens=10))  # shares a's 2 full pages, 1 of its own
    sched.add(req("c", prefix + [40, 41], max_tokens=10))
    assert run_step(sched) == {"a": 1, "b": 2, "c": 2}
    a, b, c = sched.running
    assert a.pages[0][:2] == b.pages[0][:2] == c.pages[0][:2] and blocks._refs[a.pages[0][0]] == 3
    while not sched.num_preemptions:  # decoding fills pages until one has to go
        run_step(sched)
    assert c.status.value == "waiting" and c.pages == [] and blocks._refs[a.pages[0][0]] == 2  # shared pages stay
    assert sched.abort("a").pages == [] and blocks._refs[b.pages[0][0]] == 1
    run_all(sched)
    assert [len(r.output_token_ids) for r in (b, c)] == [10, 10] and c.num_preemptions == 1
    assert_idle(blocks)


def test_when_the_pool_is_lost_no_hash_survives_and_the_running_are_recomputed():
    sched, blocks = make(budget=8)
    prefix = list(range(1, 9))
    sched.add(req("a", prefix + [20, 21, 22, 23], max_tokens=1))
    run_all(sched)  # 3 pages cached
    b, c = req("b", prefix + [30, 31, 32], max_tokens=3), req("c", range(40, 60), max_tokens=3)
    sched.add(b)
    sched.add(c)
    assert run_step(sched) == {"b": 3, "c": 5}  # b starts after a's 2 cached pages
    sched.advance(sched.schedule())  # dispatched, then the pool is lost: b's next token with it
    assert (b.num_pending_tokens, c.num_computed_tokens) == (1, 12)
    assert sched.preempt_all() == [b] and b.finish_reason.value == "error"
    blocks.reset_prefix_cache()
    assert list(sched.waiting) == [c] and (c.num_computed_tokens, c.pages, c.num_preemptions) == (0, [], 1)
    assert (blocks.used_pages, blocks.cached_pages, blocks.free_pages) == (0, 0, blocks.total_pages)
    hits = sched.prefix_cache_hits
    sched.add(req("d", prefix + [50], max_tokens=1))
    run_all(sched)
    assert sched.prefix_cache_hits == hits and len(c.output_token_ids) == 3
    assert_idle(blocks)
