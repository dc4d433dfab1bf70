"""A snapshot of what the engine is doing, for the dashboard (`GET /v1/engine/state`).

    EngineClient.call(engine_state, since) ─► runs on the engine's loop, between two steps
      ─► reads host-side state only: scheduler.running / waiting, the block manager's readers per
         page, Engine.history ─► one dict of plain values (picklable, JSON-ready)

Taking it costs no device sync and no copy of any token list: every value is a count, an id or a
page number. Requests appear by id and token counts, never by their prompt or output text.

Page owners are run-length encoded over pages 1..N (page 0 is the null page): `[[owner, count],
...]`, where an owner is the slot of the one sequence reading the page, or FREE, CACHED (unread,
kept for the prefix cache), or SHARED (read by several sequences: a prefix-cache hit). A pool past
MAX_CELLS pages is mapped in cells of `cell` consecutive pages, each showing its busiest page (a
slot before shared, cached and free), so the answer stays small for a GPU's 300k pages; the
counts stay exact. Such a map costs milliseconds, so it is then refreshed only as often as keeps
it under 1/REFRESH of the engine loop's time, however many dashboards poll.
"""

from __future__ import annotations

import itertools
import time
import weakref

import numpy as np

FREE, CACHED, SHARED = -1, -2, -3
HISTORY_DEFAULT = 64  # steps sent when the caller has none yet
HISTORY_MAX = 1024  # steps sent at most (a client that polls rarely gets the newest ones)
WAITING_MAX = 256  # waiting requests listed (all are counted)
MAX_CELLS = 4096  # pages mapped one by one up to this many; past it, in cells of several pages
REFRESH = 20  # a large pool's map is kept for 20x the time it took to build

_maps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # BlockManager -> (built at, cost, map)


def engine_state(engine, since: int | None = None) -> dict:
    """The snapshot; `since` (a step number) limits the history to the steps after it."""
    scheduler, config = engine.scheduler, engine.config
    blocks = scheduler.blocks
    now = time.monotonic()
    slots = [_free_slot(i) for i in range(config.max_slots)]
    for r in scheduler.running:
        if r.slot is None:
            continue
        prompt = len(r.prompt_token_ids)
        slots[r.slot] = {
            "slot": r.slot, "request_id": r.request_id,
            # a request decodes once only its last sampled token is left to compute
            "phase": "prefill" if r.num_uncomputed_tokens > 1 else "decode",
            "num_tokens": r.num_tokens, "num_computed_tokens": r.num_computed_tokens,
            "num_prompt_tokens": prompt, "num_output_tokens": r.num_tokens - prompt,
            "max_tokens": r.params.max_tokens, "num_cached_tokens": r.num_cached_tokens or 0,
            "pages": len(_held(r)), "age_s": round(now - r.arrival_time, 3)}
    waiting = [{"request_id": r.request_id, "num_tokens": r.num_tokens, "wait_s": round(now - r.arrival_time, 3)}
               for _, r in zip(range(WAITING_MAX), scheduler.waiting)]
    return {
        "model": getattr(engine, "model_name", "model"),
        "strategy": config.strategy,
        "step": engine.num_steps,
        "time": time.time(),
        "max_slots": config.max_slots,
        "max_model_len": engine.max_model_len,
        "token_budget": scheduler.config.max_num_batched_tokens,
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        "slots": slots,
        "waiting": waiting,
        "pages": {**_pages(blocks, scheduler.running), "groups": _groups(engine)},
        "history": _history(engine, since),
        "stats": engine.stats(),
    }


def _free_slot(i: int) -> dict:
    return {"slot": i, "request_id": None, "phase": "free", "num_tokens": 0, "num_computed_tokens": 0,
            "num_prompt_tokens": 0, "num_output_tokens": 0, "max_tokens": 0, "num_cached_tokens": 0,
            "pages": 0, "age_s": 0.0}


def _pages(blocks, running) -> dict:
    counts = {"total": blocks.total_pages, "free": blocks.free_pages, "cached": blocks.cached_pages,
              "used": blocks.used_pages, "page_size": blocks.page_size}
    now = time.perf_counter()
    kept = _maps.get(blocks)
    if blocks.total_pages > MAX_CELLS and kept is not None and now - kept[0] < REFRESH * kept[1]:
        return {**counts, **kept[2]}
    page_map = _page_map(blocks, running)
    _maps[blocks] = (now, time.perf_counter() - now, page_map)
    return {**counts, **page_map}


def _page_map(blocks, running) -> dict:
    readers = blocks.page_states()
    owner = np.where(readers == 0, FREE, np.where(readers < 0, CACHED, SHARED)).astype(np.int64)
    held = [(r.slot, _held(r)) for r in running if r.slot is not None]
    held = [(slot, pages) for slot, pages in held if pages]
    if held:
        pages = np.concatenate([np.asarray(p, np.int64) for _, p in held])
        slots = np.repeat([slot for slot, _ in held], [len(p) for _, p in held])
        alone = readers[pages] == 1
        owner[pages[alone]] = slots[alone]
    owner = owner[1:]  # page 0 is the null page
    cell = -(-len(owner) // MAX_CELLS)
    if cell > 1:  # rank: free 0, cached 1, shared 2, slot s 3 + s; a cell shows its highest
        rank = np.where(owner >= 0, owner + 3, -owner - 1)
        rank = np.pad(rank, (0, -len(rank) % cell)).reshape(-1, cell).max(axis=1)
        owner = np.where(rank >= 3, rank - 3, -rank - 1)
    starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
    counts = np.diff(np.r_[starts, len(owner)])
    return {"shared": int((readers > 1).sum()), "cell": cell,
            "owners": np.stack([owner[starts], counts], axis=1).tolist()}


def _groups(engine) -> list[dict]:
    """Pages per KV-cache group (the free pages belong to none)."""
    return [{"window": g["window"], "used": g["used_pages"], "cached": g["cached_pages"]}
            for g in engine.kv_group_pages()]


def _held(request) -> list[int]:
    """The pages a request reads, in every KV-cache group (not the null entries a window dropped)."""
    return [p for table in request.pages for p in table if p]


def _history(engine, since: int | None) -> list[dict]:
    """The last steps, oldest first, each with its step number (the newest is engine.num_steps)."""
    history = engine.history
    first = engine.num_steps - len(history) + 1  # step number of history[0]
    if since is None:
        start = max(0, len(history) - HISTORY_DEFAULT)
    else:
        start = min(len(history), max(0, since + 1 - first, len(history) - HISTORY_MAX))
    out = []
    for i, h in enumerate(itertools.islice(history, start, None), start):
        out.append({"step": first + i, "time": h.time, "tokens": h.tokens, "decode_rows": h.decode_rows,
                    "prefill_tokens": h.prefill_tokens, "running": h.running, "waiting": h.waiting,
                    "used_pages": h.used_pages, "cached_pages": h.cached_pages})
    return out
