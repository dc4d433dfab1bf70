"""A snapshot of what the engine is doing, for the dashboard (`GET /v1/engine/state`).

    EngineClient.call(engine_state, since) ─► runs on the engine's loop, between two steps
      ─► reads host-side state only: scheduler.running / waiting, the block manager's readers per
         page, Engine.history ─► one dict of plain values (picklable, JSON-ready)

Taking it costs no device sync and no copy of any token list: every value is a count, an id or a
page number. Requests appear by id and token counts, never by their prompt or output text.

Page owners are run-length encoded over pages 1..N (page 0 is the null page): `[[owner, count],
...]`, where an owner is the slot of the one sequence reading the page, or FREE, CACHED (unread,
kept for the prefix cache), or SHARED (read by several sequences: a prefix-cache hit). A pool of
100k pages is then a few hundred runs, not 100k numbers.
"""

from __future__ import annotations

import itertools
import time

FREE, CACHED, SHARED = -1, -2, -3
HISTORY_DEFAULT = 64  # steps sent when the caller has none yet
HISTORY_MAX = 1024  # steps sent at most (a client that polls rarely gets the newest ones)
WAITING_MAX = 256  # waiting requests listed (all are counted)


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
            "pages": len(r.pages), "age_s": round(now - r.arrival_time, 3)}
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
        "pages": _pages(blocks, scheduler.running),
        "history": _history(engine, since),
        "stats": engine.stats(),
    }


def _free_slot(i: int) -> dict:
    return {"slot": i, "request_id": None, "phase": "free", "num_tokens": 0, "num_computed_tokens": 0,
            "num_prompt_tokens": 0, "num_output_tokens": 0, "max_tokens": 0, "num_cached_tokens": 0,
            "pages": 0, "age_s": 0.0}


def _pages(blocks, running) -> dict:
    readers = blocks.page_readers()
    owner = [FREE if n == 0 else CACHED if n < 0 else SHARED for n in readers]
    for r in running:
        if r.slot is not None:
            for p in r.pages:
                if readers[p] == 1:
                    owner[p] = r.slot
    runs: list[list[int]] = []
    for o in owner[1:]:  # page 0 is the null page
        if runs and runs[-1][0] == o:
            runs[-1][1] += 1
        else:
            runs.append([o, 1])
    return {"total": blocks.total_pages, "free": blocks.free_pages, "cached": blocks.cached_pages,
            "used": blocks.used_pages, "shared": sum(1 for n in readers if n > 1),
            "page_size": blocks.page_size, "owners": runs}


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
