"""KV-cache groups without jax: the layers' grouping, and the scheduler over one pool with a
full-attention group and sliding-window groups, with exact expected page lists: pages leave a
sliding group at the step their window passes them, freed hashed pages stay cached, a prefix hit
across a window edge takes the right pages per group, abort and preemption mid-prefill free every
group's pages, and an idle pool is free plus cached pages in every group."""

import numpy as np

from jaxserve.engine.batching import BlockManager, Request, SamplingParams, Scheduler, SchedulerConfig, make_policy
from jaxserve.engine.batching.kv_cache_manager import KVCacheManager
from jaxserve.model.config import ModelConfig
from jaxserve.model.kv_groups import kv_groups

S = 4  # page size
W = 8  # the sliding window: a query at p sees p - 7 .. p


def make(windows=(None, W), num_pages=33, max_slots=2, max_model_len=64, budget=8, caching=True):
    blocks = BlockManager(num_pages, S, enable_caching=caching, num_groups=len(windows))
    config = SchedulerConfig(max_slots=max_slots, max_model_len=max_model_len, max_num_batched_tokens=budget,
                             kv_group_windows=windows)
    return Scheduler(config, blocks, make_policy("paged")), blocks


def req(rid, tokens, max_tokens=2):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), seed=0, arrival_time=0.0)


def run_step(sched):
    s = sched.schedule()
    sched.update(s, np.array([100 + r.num_tokens for r in s.num_tokens]))
    return {r.request_id: n for r, n in s.num_tokens.items()}


def assert_idle(blocks):
    for g in range(blocks.num_groups):
        assert blocks.group_pages(g)[0] == 0, f"group {g} holds used pages"
    cached = sum(blocks.group_pages(g)[1] for g in range(blocks.num_groups))
    assert cached == blocks.cached_pages and blocks.free_pages + cached == blocks.total_pages
    assert all(r == 0 for r in blocks._refs)


# ---- grouping ----

def config(windows):
    return ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=len(windows), num_heads=1,
                       num_kv_heads=1, head_dim=8, layer_windows=windows)


def test_layers_group_by_kind_into_pages_of_the_smallest_kind():
    gemma3 = kv_groups(config(([512] * 5 + [None]) * 3))  # Gemma 3 270M: 15 local, 3 global
    assert gemma3.windows == (None, 512, 512, 512, 512, 512) and gemma3.layers_per_page == 3
    assert gemma3.layer_group[:7] == (1, 1, 1, 2, 2, 0, 2) and gemma3.layer_slot[:7] == (0, 1, 2, 0, 1, 0, 2)
    llama = kv_groups(config((None,) * 4))
    assert (llama.windows, llama.layers_per_page, llama.layer_slot) == ((None,), 4, (0, 1, 2, 3))
    odd = kv_groups(config(([64] * 5 + [None]) * 2 + [64] * 2))  # 12 local, 2 global: 6 local groups of 2
    assert odd.windows == (None,) + (64,) * 6 and odd.layers_per_page == 2
    uneven = kv_groups(config((16, 16, 16, None, None)))  # 3 local in groups of 2: the last has a spare slot
    assert uneven.windows == (None, 16, 16) and uneven.layer_group == (1, 1, 2, 0, 0)


# ---- the sliding group's pages ----

def test_pages_leave_the_sliding_group_at_the_step_the_window_passes_them():
    sched, blocks = make()
    a = req("a", range(1, 17), max_tokens=6)  # 16 tokens: 4 pages
    sched.add(a)
    seen = []
    for _ in range(7):
        run_step(sched)
        seen.append([list(t) for t in a.pages] if a.pages else None)
    assert seen == [
        [[1, 2, 3, 4], [5, 6]],  # the full group holds the prompt, the sliding one what a step reaches
        [[1, 2, 3, 4], [5, 6, 7, 8]],
        [[1, 2, 3, 4, 9], [0, 0, 7, 8, 10]],  # the next query (16) sees 9..16: pages 0 and 1 go
        [[1, 2, 3, 4, 9], [0, 0, 7, 8, 10]],
        [[1, 2, 3, 4, 9], [0, 0, 7, 8, 10]],
        [[1, 2, 3, 4, 9], [0, 0, 0, 8, 10]],  # query 19 sees 12..19: page 2 goes
        None,  # the 6th token: finished
    ]
    assert a.finish_reason.value == "length"
    # Dropped pages were full and hashed: cached, oldest first; then the release, each group's tail first.
    assert list(blocks._evictable) == [5, 6, 7, 9, 4, 3, 2, 1, 10, 8]
    assert [blocks.group_pages(g) for g in (0, 1)] == [(0, 5), (0, 5)]
    assert_idle(blocks)


def test_the_block_table_rows_follow_the_drops():
    sched, blocks = make()
    a = req("a", range(1, 17), max_tokens=6)
    sched.add(a)
    for _ in range(3):
        run_step(sched)
    tables = np.zeros((2, 2, 64), np.int32)  # the device's tables, from the entries recorded, in order
    for slot, group, index, page in sched.table.take_updates():
        tables[slot, group, index] = page
    assert tables[a.slot, :, :6].tolist() == [[1, 2, 3, 4, 9, 0], [0, 0, 7, 8, 10, 0]]
    assert (blocks.group_pages(0), blocks.group_pages(1), blocks.cached_pages) == ((5, 0), (3, 2), 2)


def test_without_caching_a_dropped_page_is_free_at_once():
    sched, blocks = make(caching=False)
    a = req("a", range(1, 17), max_tokens=6)
    sched.add(a)
    for _ in range(3):
        run_step(sched)
    assert a.pages == [[1, 2, 3, 4, 6], [0, 0, 7, 8, 5]]  # 5 and 6 freed, then handed out again
    assert blocks.cached_pages == 0


def test_a_long_prompt_reserves_only_a_step_in_the_sliding_group():
    sched, blocks = make(max_model_len=128)
    sched.add(req("long", range(1, 101)))  # 100 tokens: 25 pages in the full group
    assert run_step(sched) == {"long": 8}
    assert (blocks.group_pages(0), blocks.group_pages(1)) == ((25, 0), (2, 0))
    for _ in range(11):
        run_step(sched)
    assert (blocks.group_pages(0)[0], blocks.group_pages(1)[0]) == (25, 4)  # the window and a step, not 25


# ---- prefix hits across groups ----

def test_a_prefix_hit_across_a_window_edge_takes_the_right_pages_per_group():
    sched, blocks = make(num_pages=15)  # 14 usable pages
    sched.add(req("a", range(1, 22), max_tokens=1))  # 21 tokens in 3 steps of 8
    while sched.has_unfinished():
        run_step(sched)
    # Full group: 1..6 (6 partial, freed); sliding: 7, 8 dropped in step 3, then 9..12 (12 partial, freed).
    assert list(blocks._evictable) == [7, 8, 5, 4, 3, 2, 1, 11, 10, 9]
    evict = blocks.allocate(6)  # the free 12, 6, 13, 14, then the two oldest cached: 7 and 8
    assert evict == [12, 6, 13, 14, 7, 8]
    blocks.free(evict)
    b = req("b", list(range(1, 21)) + [99])  # a's first 5 pages, then its own token
    sched.add(b)
    assert run_step(sched) == {"b": 1}  # all 20 tokens hit: the sliding group lost only pages out of its window
    assert b.num_cached_tokens == 20
    # A query at 20 sees 13..20: the sliding group shares pages 3 and 4 only; page 9 (index 2) stays cached.
    assert b.pages == [[1, 2, 3, 4, 5, 8], [0, 0, 0, 10, 11, 7]]
    assert blocks._refs[9] == 0 and 9 in blocks._evictable
    sched.abort("b")
    assert_idle(blocks)


def cached_chains(full_missing=(), sliding_missing=()):
    """A full group holding pages 1..5 and a sliding one 6..10 for the hashes of 5 pages, all
    cached, less the pages named missing."""
    blocks = BlockManager(20, S, num_groups=2)
    hashes = [bytes([i]) * 32 for i in range(5)]
    full, sliding = blocks.allocate(5, 0), blocks.allocate(5, 1)
    for g, (pages, missing) in enumerate(((full, full_missing), (sliding, sliding_missing))):
        for i, page in enumerate(pages):
            if i not in missing:
                blocks.cache(page, hashes[i], g)
    blocks.free(full + sliding)
    return KVCacheManager(blocks, (None, W)), hashes


def test_a_sliding_group_serves_a_hit_with_the_pages_its_window_sees():
    kv, hashes = cached_chains(sliding_missing=(0, 1))
    assert kv.cache_hits(hashes) == (5, [[1, 2, 3, 4, 5], [0, 0, 0, 9, 10]])  # a query at 20 sees 13..20


def test_a_hit_stops_where_a_sliding_group_misses_a_page_its_window_needs():
    kv, hashes = cached_chains(sliding_missing=(4,))
    assert kv.cache_hits(hashes) == (4, [[1, 2, 3, 4], [0, 0, 8, 9]])  # at 16 the window needs 9..16 only
    kv, hashes = cached_chains(sliding_missing=(1, 3))
    assert kv.cache_hits(hashes) == (1, [[1], [6]])  # the window of every longer hit has a hole


def test_a_hit_is_no_longer_than_the_full_group_holds():
    kv, hashes = cached_chains(full_missing=(3,))
    assert kv.cache_hits(hashes) == (3, [[1, 2, 3], [0, 7, 8]])
    kv, hashes = cached_chains(full_missing=(0,))
    assert kv.cache_hits(hashes) == (0, [[], []])


# ---- abort, preemption, idle ----

def test_preemption_in_the_middle_of_a_prefill_frees_every_groups_pages():
    sched, blocks = make(num_pages=9, caching=False)  # 8 usable
    a, b = req("a", range(1, 5), max_tokens=20), req("b", range(50, 66))
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == {"a": 4, "b": 4}
    assert (a.pages, b.pages) == ([[1], [2]], [[3, 4, 5, 6], [7, 8]])
    s = sched.schedule()  # a's 5th token needs a page in each group: b, mid-prefill, gives all its back
    assert s.preempted == [b] and b.pages == [] and b.num_computed_tokens == 0
    assert a.pages == [[1, 7], [2, 8]]
    assert (blocks.group_pages(0), blocks.group_pages(1), blocks.free_pages) == ((2, 0), (2, 0), 4)


def test_abort_in_the_middle_of_a_prefill_frees_every_groups_pages():
    sched, blocks = make()
    b = req("b", range(1, 33))  # 32 tokens: 8 pages in the full group
    sched.add(b)
    for _ in range(3):
        run_step(sched)
    assert b.pages == [[1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 11, 12, 13, 14]] and b.num_computed_tokens == 24
    sched.abort("b")
    assert b.pages == [] and b.finish_reason.value == "abort"
    # 6 computed pages per group stay cached (9 and 10 since they left the window); 7 and 8 are free.
    assert list(blocks._evictable) == [9, 10, 6, 5, 4, 3, 2, 1, 14, 13, 12, 11]
    assert [blocks.group_pages(g) for g in (0, 1)] == [(0, 6), (0, 6)]
    assert_idle(blocks)


def test_a_busy_pool_with_three_groups_ends_idle():
    rng = np.random.default_rng(0)
    sched, blocks = make(windows=(None, 8, 12), num_pages=40, max_slots=4, max_model_len=96, budget=16)
    requests = []
    for i in range(24):
        prefix = [1, 2, 3, 4, 5, 6, 7, 8, 9] if i % 2 else []
        r = req(f"r{i}", prefix + rng.integers(10, 90, int(rng.integers(4, 50))).tolist(),
                max_tokens=int(rng.integers(1, 30)))
        requests.append(r)
        sched.add(r)
    step = 0
    while sched.has_unfinished():
        s = sched.schedule()
        for r in sched.running:  # a sliding group holds exactly the pages from the next query's window on
            for window, table in zip((None, 8, 12), r.pages):
                first = 0 if window is None else max(0, r.num_computed_tokens - window + 1) // S
                assert not any(table[:first]) and all(table[first:])
        sched.update(s, np.array([100 + r.num_tokens for r in s.num_tokens]))
        step += 1
        if step == 15:
            sched.abort("r3")
    assert sched.num_preemptions > 0 and sched.prefix_cache_hits > 0
    for r in requests:
        assert r.finished and (r.request_id == "r3" or len(r.output_token_ids) == r.params.max_tokens)
    assert_idle(blocks)
