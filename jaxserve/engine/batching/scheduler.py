"""Token-budget scheduler over a fixed number of batch slots.

Every step it (1) makes sure each running sequence has pages for all its tokens, preempting the
most recently admitted sequence when pages run out, (2) admits waiting requests as the strategy's
policy allows while slots and pages last, and (3) fills the step's token budget: one token for
every sequence that is decoding, then prompt chunks in admission order. A request's
`num_computed_tokens` advances by what it ran; it samples when its last prompt chunk runs, then
decodes. Once the step is dispatched, `advance` moves the computed counts on and gives every
request that sampled a pending token, so the next step can be scheduled before this one's tokens
reach the host; `commit` then appends those tokens and retires finished sequences, freeing their
slots and pages (`update` does both, for a step run in order).

The strategy decides who is admitted; the budget decides how many tokens run. Admission takes
pages for the whole prompt at once in full-attention groups; sliding-window groups take only what
a step can reach and free what their window left behind, every step (`kv_cache_manager`), so a
long prefill may wait for (or be preempted for) their few new pages. With chunked prefill off, a
prompt runs whole in one step.

Prefix caching: admission looks the prompt's leading full pages up by content hash; each hit is
shared (one more reader) and the prefill starts after it, but the last prompt token is always
computed, so a first token can be sampled. As pages fill with computed tokens, `update` records
them in the cache; a finished, aborted or preempted request's pages stay there until evicted.
A request whose next page another running request is computing waits for it (paged and
continuous only), so a prefix shared by many requests that arrive together is computed once.
When the pool's K/V are lost (a failed step consumed it), `preempt_all` sends every running
request back to be recomputed; when a failed step's pages may hold K/V never written, `forget`
drops their hashes and sends back whoever reads them.

A request whose own scheduling raises (its admission, page growth, sliding-window pass) ends alone
with `error`; the policy raising ends the queue's head, whose admission it was deciding. An
exception that no request's code raised (filling the budget) ends the requests this schedule
admitted, the newest state, which is most likely to hold the bug; if it admitted none, the running
requests, so that a fault that repeats cannot stall the engine with requests that never end.

The slot table (`slot_table`) records what changed per slot (block-table entries, sampling
parameters) for the runner, which keeps the tables on the device; the running requests' counters
are arrays by slot (`slot_counters`), so a step's decodes are scheduled, advanced and committed
as numpy operations, and Python looks only at the requests that cross a page, run a prompt chunk,
sample their first token or end; the prefix cache's bookkeeping
is `prefix_cache`; `stop_ids` holds the ids that end some unfinished request, which `commit`
tests a step's tokens against. With several decode steps per dispatch, `look_ahead` gives each
decoding request the pages of the steps it may run.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import itertools
import operator
import time
from collections import deque
from typing import Callable

import numpy as np

from jaxserve.engine.batching.block_manager import BlockManager
from jaxserve.engine.batching.kv_cache_manager import KVCacheManager
from jaxserve.engine.batching.policies import Policy
from jaxserve.engine.batching.prefix_cache import PrefixCache
from jaxserve.engine.batching.request import PENDING, FinishReason, Request, RequestStatus
from jaxserve.engine.batching.slot_counters import (CACHED_PAGES, COMPUTED, DECODING, GENERATION, LAST_TOKEN,
                                                    MAX_TOKENS, PENDING_TOKENS, STOPPING, TABLE_TOKENS, SlotCounters)
from jaxserve.engine.batching.slot_table import SlotTable
from jaxserve.engine.batching.speculation import Speculator, accepted
from jaxserve.engine.batching.stop_ids import StopIds
from jaxserve.faults import faults

log = logging.getLogger(__name__)

_output_of = operator.attrgetter("output_token_ids")


def _no_slots() -> np.ndarray:
    return np.zeros(0, np.int64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_slots: int
    max_model_len: int
    max_num_batched_tokens: int  # the token budget of one step
    enable_chunked_prefill: bool = True
    eos_token_ids: tuple[int, ...] = ()
    kv_group_windows: tuple[int | None, ...] = (None,)  # per KV-cache group: its sliding window, None: full
    stop_ids_width: int = 8  # the stop token ids a slot keeps for the device (multi-step decode)

    def __post_init__(self):
        if self.max_num_batched_tokens < self.max_slots:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_slots "
                             f"({self.max_slots}): every running sequence decodes one token per step")


@dataclasses.dataclass
class Schedule:
    """One step: the tokens each request runs, decodes first, then prompt chunks in admission order."""

    num_tokens: dict[Request, int]  # Requests hash by identity
    admitted: list[Request]
    preempted: list[Request]
    sampling: set[Request] = dataclasses.field(default_factory=set)  # whose last uncomputed token runs
    num_decodes: int = 0  # the requests that run one token (the first ones of num_tokens)
    decode_steps: int = 1  # > 1: every request decodes, num_tokens[r] steps in one dispatch (`look_ahead`)
    cached_pages: list[int] = dataclasses.field(default_factory=list)  # pages `advance` put in the prefix cache
    drafts: dict[Request, list[int]] = dataclasses.field(default_factory=dict)  # decodes' draft tokens (speculation)
    failed: list[Request] = dataclasses.field(default_factory=list)  # ended with `error`: scheduling them raised
    decode_slots: np.ndarray = dataclasses.field(default_factory=_no_slots)  # the decodes' slots, in step order ...
    decode_generations: np.ndarray = dataclasses.field(default_factory=_no_slots)  # ... their generations (`SlotCounters`)

    @property
    def empty(self) -> bool:
        return not self.num_tokens

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens.values())

    def samples(self, request: Request) -> bool:
        """Whether `request` samples a token this step (its last uncomputed token runs)."""
        return request in self.sampling


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, policy: Policy,
                 clock: Callable[[], float] = time.monotonic, speculator: Speculator | None = None):
        self.config = config
        self.speculator = speculator  # drafts tokens for decoding requests (None: no speculation)
        self.blocks = blocks
        self.policy = policy
        self.clock = clock
        self.kv = KVCacheManager(blocks, config.kv_group_windows, config.max_num_batched_tokens)
        self.table = SlotTable(config.max_slots, config.eos_token_ids, config.stop_ids_width)
        self.counters = SlotCounters(config.max_slots)
        self.waiting: deque[Request] = deque()
        self._free_slots = list(range(config.max_slots))  # a heap: the lowest free slot first
        self.prefix = PrefixCache(blocks, self.kv)
        self._failed: list[Request] = []  # this schedule's requests whose scheduling raised
        self.stop_ids = StopIds(config.eos_token_ids)  # those that end some unfinished request
        # Filled a page whose last token was on the device at `advance`: the schedule whose step
        # writes that page's K/V, which then lists the page among its cached_pages when recorded.
        self._unrecorded: dict[Request, Schedule] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission ...
        self.prefix_cache_hits = 0  # ... and found

    # ---- queue ----

    def add(self, request: Request) -> None:
        request.max_num_tokens = min(request.max_num_tokens, self.config.max_model_len)
        self.stop_ids.add(request)
        self.waiting.append(request)

    @property
    def running(self) -> list[Request]:
        """The requests holding a slot, in admission order."""
        return self.counters.requests[self.counters.order].tolist()

    @property
    def num_running(self) -> int:
        return len(self.counters.order)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or self.num_running > 0

    def abort(self, request_id: str) -> Request | None:
        """Ends a waiting or running request with `abort`; returns it, or None if unknown."""
        for request in list(self.waiting) + self.running:
            if request.request_id == request_id:
                self.finish(request, FinishReason.ABORT)
                return request
        return None

    # ---- one iteration ----

    def schedule(self) -> Schedule:
        """The next step. A request whose own scheduling raises ends with `error` (in
        `Schedule.failed`, logged), and the others are scheduled as if it had never been. An
        exception no request's code raised ends those this schedule admitted (or, if none, the
        running ones) with `error`, and the step runs nothing."""
        self._failed, admitted = [], []
        try:
            running = self.counters.order
            if self.kv.has_windows:
                self._drop_out_of_window(running)
            decodes, decode_slots, chunks, preempted = self._grow_running(running)
            if not preempted:
                self._admit(admitted)
            admitted_decodes = [r for r in admitted if r.num_uncomputed_tokens == 1]
            decodes += admitted_decodes
            chunks += [(r, r.num_uncomputed_tokens) for r in admitted if r.num_uncomputed_tokens > 1]
            schedule = self._fill_budget(decodes, chunks, admitted, preempted)
            if admitted_decodes:
                decode_slots = np.concatenate([decode_slots, [r.slot for r in admitted_decodes]]).astype(np.int64)
            schedule.decode_slots = decode_slots
            schedule.decode_generations = self.counters.generation[decode_slots]
            if self.speculator is not None and decodes and not preempted:
                self._draft(schedule)
        except Exception:  # noqa: BLE001 — no request's own code raised: see the module's docstring
            log.exception("scheduling failed outside any one request's part: %s end with error",
                          "the requests it admitted" if admitted else "the running requests")
            for request in admitted or list(self.running):
                if not request.finished:
                    self.finish(request, FinishReason.ERROR)
                    self._failed.append(request)
            schedule = Schedule({}, [], [])
        schedule.failed = self._failed
        return schedule

    def _fail(self, request: Request) -> None:
        """Ends with `error` a request whose scheduling raised, freeing what it holds."""
        log.exception("scheduling request %s failed: it ends with error", request.request_id)
        if request.status is RequestStatus.WAITING and request not in self.waiting:
            self.waiting.append(request)  # taken out for admission: `finish` takes it out again
        self.finish(request, FinishReason.ERROR)
        self._failed.append(request)

    def _fill_budget(self, decodes: list[Request], chunks: list[tuple[Request, int]], admitted, preempted) -> Schedule:
        """One token for every decode (at most max_slots <= budget of them), then prompt chunks in
        admission order while the budget lasts."""
        tokens = dict.fromkeys(decodes, 1)
        sampling = set(decodes)
        budget = self.config.max_num_batched_tokens - len(tokens)
        for request, left in chunks:
            if budget == 0:
                break
            if left > budget and not self.config.enable_chunked_prefill:
                break  # whole prompts only: this one and those behind it wait for a step with room
            n = tokens[request] = min(left, budget)
            budget -= n
            if n == left:
                sampling.add(request)
        return Schedule(tokens, admitted, preempted, sampling, num_decodes=len(decodes))

    def _draft(self, schedule: Schedule) -> None:
        """Gives decoding requests draft tokens to verify (`speculation`), within the budget the
        step leaves and the pages free now (no one is preempted for a draft)."""
        budget = self.config.max_num_batched_tokens - schedule.total_tokens
        if budget <= 0 or not self.speculator.new_step(self.num_running):
            return
        for request in list(schedule.num_tokens)[:schedule.num_decodes]:
            if request.stopping or request.num_pending_tokens:
                continue
            room = min(budget, request.max_num_tokens - request.num_tokens - 1)
            drafts = self.speculator.drafts(request, room)
            if not drafts:
                continue
            end = request.num_tokens + len(drafts)
            lengths = [len(t) for t in request.pages]
            if end > request.num_table_tokens:
                if not self.blocks.can_allocate(self.kv.pages_to_add(lengths, request.num_computed_tokens, end)):
                    continue
                self._grow(request, end, lengths)
            schedule.num_tokens[request] = 1 + len(drafts)
            schedule.drafts[request] = drafts
            budget -= len(drafts)
            if budget <= 0:
                return

    def look_ahead(self, schedule: Schedule, steps: int) -> bool:
        """Turns a schedule of decodes only into up to `steps` decode steps in one dispatch: each
        request runs as many as its max_tokens and the context leave it (num_tokens[r]), and gets
        now the pages they write. Returns False, the schedule unchanged, when the pages are not
        free (no one is preempted for it) or no request would run more than one."""
        max_model_len, plan, needed = self.config.max_model_len, [], 0
        for request in schedule.num_tokens:
            n = min(steps, request.params.max_tokens - len(request.output_token_ids) - request.num_pending_tokens,
                    max_model_len - request.num_tokens)
            end = request.num_computed_tokens + n
            if end > request.num_table_tokens:
                needed += self.kv.pages_to_add([len(t) for t in request.pages], request.num_computed_tokens, end)
            plan.append(n)
        if max(plan, default=1) <= 1 or not self.blocks.can_allocate(needed):
            return False
        for request, n in zip(list(schedule.num_tokens), plan):
            if request.num_computed_tokens + n > request.num_table_tokens:
                self._grow(request, request.num_computed_tokens + n)
            schedule.num_tokens[request] = n
        schedule.decode_steps = steps
        return True

    def _drop_out_of_window(self, running: np.ndarray) -> None:
        """Frees what sliding windows left behind, for the requests in the `running` slots that
        have computed past their next window drop (a few a step)."""
        counters = self.counters
        due = running[counters.num_computed_tokens[running] >= counters.next_window_drop[running]]
        for request in counters.requests[due].tolist():
            try:
                dropped = self.kv.drop_out_of_window(request)
            except Exception:  # noqa: BLE001 — that request's bookkeeping, not everyone's
                self._fail(request)
                continue
            if dropped:
                self.table.write_null(request.slot, dropped)

    def _grow_running(self, running: np.ndarray) -> tuple[list[Request], np.ndarray, list[tuple[Request, int]],
                                                          list[Request]]:
        """Gives each request in the `running` slots (in admission order) the pages its tokens
        need, preempting the newest when out, and sorts them: (decodes, their slots, (prompt
        chunk, tokens left), preempted). A request that decodes runs one token: only those that
        cross a page, and those with other than one token left, are looked at one by one."""
        counters, running_status = self.counters, RequestStatus.RUNNING
        if self._failed:  # ended by their window drops
            running = counters.order
        columns, requests = counters.values[:, running], counters.requests[running]
        stopping, decoding = columns[STOPPING], columns[DECODING]
        plain = decoding > stopping  # decodes: one token each
        crossing = plain & (columns[COMPUTED] >= columns[TABLE_TOKENS])  # its token needs a new page
        special = np.flatnonzero(crossing | ((decoding | stopping) == 0))
        if special.size and crossing[special].all() and self._add_decode_pages(requests[special], running[special]):
            special = special[:0]  # decodes only, each given its next page at once
        if not special.size:  # decodes only (most steps)
            return requests[plain].tolist(), running[plain], [], []
        preempted, left = [], plain.astype(np.int64)
        totals = np.where(crossing, columns[COMPUTED] + 1, -1)[special]
        for i, total in zip(special.tolist(), totals.tolist()):
            request = requests[i]
            if request.status is not running_status:
                continue  # preempted earlier in this loop (only later ones are)
            if total < 0:  # not a decode: a prompt to run, or its first token to commit
                total = request.num_tokens
                left[i] = total - request.num_computed_tokens
                if total <= request.num_table_tokens:
                    continue
            try:
                self._add_pages(request, total, preempted)
            except Exception:  # noqa: BLE001 — that request's bookkeeping, not everyone's
                self._fail(request)
        if preempted or self._failed:
            left[counters.generation[running] != columns[GENERATION]] = 0  # sent back or ended in this loop
        decodes, chunks = np.flatnonzero(left == 1), np.flatnonzero(left > 1)
        return (requests[decodes].tolist(), running[decodes],
                list(zip(requests[chunks].tolist(), left[chunks].tolist())), preempted)

    def _add_decode_pages(self, requests: np.ndarray, slots: np.ndarray) -> bool:
        """Gives decodes whose token starts a new page that page, at once, where one full-attention
        group is all there is and the pool holds them all; False, nothing done, otherwise (they
        go one by one, preempting the newest while the pool is short)."""
        if faults.armed or self.kv.windows != (None,) or not self.blocks.can_allocate(len(slots)):
            return False
        pages = self.blocks.allocate(len(slots))
        for request, page in zip(requests.tolist(), pages):
            request.pages[0].append(page)
        self.table.write_entries(slots, 0, self.counters.num_table_tokens[slots] // self.blocks.page_size, pages)
        self.counters.num_table_tokens[slots] += self.blocks.page_size
        return True

    def _add_pages(self, request: Request, total: int, preempted: list[Request]) -> None:
        """Gives a running request the pages its `total` tokens need, preempting the newest
        (maybe itself) while the pool is short."""
        if faults.armed:
            faults.check("schedule", request.request_id)
        lengths = [len(t) for t in request.pages]
        needed = self.kv.pages_to_add(lengths, request.num_computed_tokens, total)
        while needed > 0 and not self.blocks.can_allocate(needed):
            victim = self.counters.requests[self.counters.order[-1]]
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return
        if needed > 0:
            self._grow(request, total, lengths)

    def _grow(self, request: Request, end: int, lengths: list[int] | None = None) -> None:
        """Gives a running request the pages its first `end` tokens need (they must be free), and
        records its new block-table entries for the device (from `lengths`, its tables' lengths)."""
        lengths = [len(t) for t in request.pages] if lengths is None else lengths
        self.kv.grow(request, end)
        self.table.write_pages(request.slot, request, lengths)

    def _admit(self, admitted: list[Request]) -> None:
        """Admits waiting requests into `admitted` (filled as it goes: a failure later in the
        schedule knows whom it admitted)."""
        held_back = []
        try:
            allowed = self.policy.admissible(self.waiting, self.num_running, self.clock())
        except Exception:  # noqa: BLE001 — the policy was deciding about the queue's head: it ends, the rest wait
            if self.waiting:
                self._fail(self.waiting.popleft())
            return
        while allowed > 0 and self.waiting and self._free_slots:
            request = self.waiting.popleft()
            try:
                outcome = self._admit_one(request, held_back)
            except Exception:  # noqa: BLE001 — that request's bookkeeping, not everyone's
                self._fail(request)
                continue
            if outcome is None:
                break
            if outcome:
                admitted.append(request)
                allowed -= 1
        self.waiting.extendleft(reversed(held_back))

    def _admit_one(self, request: Request, held_back: list[Request]) -> bool | None:
        """Admits a request taken from the queue: True; False when it is held back for a prefix
        being computed; None when the pool is short (it goes back to the queue's head)."""
        if faults.armed:
            faults.check("schedule", request.request_id)
        page_size = self.blocks.page_size
        hit, tables, hashes = self.prefix.hits(request)
        if self.policy.waits_for_shared_prefix and self.prefix.being_computed(hashes, hit):
            held_back.append(request)  # its next page is being computed: take it from the cache later
            return False
        tokens = self.config.max_model_len if self.policy.reserve_full_context else request.num_tokens
        needed = self.kv.pages_to_add([hit] * self.kv.num_groups, hit * page_size, tokens)
        shared = [p for table in tables for p in table if p]
        if not self.blocks.can_allocate(needed, keeping=shared):
            self.waiting.appendleft(request)
            return None
        request.status = RequestStatus.RUNNING
        request.slot = heapq.heappop(self._free_slots)
        self.counters.attach(request)
        if request.admit_time is None:
            request.admit_time = self.clock()
        self.blocks.share(shared)
        request.pages = tables
        request.num_computed_tokens, request.num_cached_pages = hit * page_size, hit
        self.kv.grow(request, tokens)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = request.num_computed_tokens
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += request.num_computed_tokens
        self.prefix.claim(request, hashes[hit:])
        self.table.fill(request.slot, request)
        return True

    def _release(self, request: Request) -> None:
        if self.speculator is not None:
            self.speculator.forget(request)
        self.kv.release(request)
        self.prefix.release(request)
        if request.slot is not None:
            self.table.clear(request.slot)
            heapq.heappush(self._free_slots, request.slot)
            self.counters.detach(request)
            request.slot = None

    def _preempt(self, request: Request) -> None:
        """Frees a running sequence's pages; it is recomputed from its tokens when readmitted."""
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = request.num_cached_pages = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def preempt_all(self) -> list[Request]:
        """Preempts every running request, for when the pool's K/V are gone: each is recomputed
        from its tokens, in admission order. One whose sampled token is still on the device cannot
        be (that token is gone too): it ends with `error`. Returns those."""
        lost = [r for r in self.running if r.num_pending_tokens]
        for request in lost:
            self.finish(request, FinishReason.ERROR)
        for request in self.running[::-1]:  # newest first: each goes to the front of the queue
            self._preempt(request)
        return lost

    def forget(self, pages: list[int]) -> list[Request]:
        """For a failed step: the K/V of `pages` may never have been written. Forgets their
        hashes, and sends each running request that reads one back to be recomputed (a prefix-cache
        hit taken after the step was dispatched, by a request that has run nothing since); one
        whose sampled token is still on the device cannot be, and ends with `error`. Returns those."""
        if not pages:
            return []
        self.blocks.forget(pages)
        lost = set(pages)
        readers = [r for r in self.running if any(p in lost for table in r.pages for p in table)]
        failed = [r for r in readers if r.num_pending_tokens]
        for request in failed:
            self.finish(request, FinishReason.ERROR)
        for request in readers[::-1]:  # newest first: each goes to the front of the queue
            if not request.finished:
                self._preempt(request)
        return failed

    def decode_inputs(self, schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
        """The schedule's decodes' positions (their computed tokens) and the token each runs: its
        last one, or PENDING while that one is still on the device."""
        columns = self.counters.values[:, schedule.decode_slots]
        return columns[COMPUTED], np.where(columns[PENDING_TOKENS] > 0, PENDING, columns[LAST_TOKEN])

    # ---- results ----

    def update(self, schedule: Schedule, tokens: np.ndarray, logprobs: list[dict] | None = None) -> list[Request]:
        """`advance` then `commit`: the whole bookkeeping of a step run in order."""
        self.advance(schedule)
        return self.commit(schedule, tokens, logprobs)

    def advance(self, schedule: Schedule) -> None:
        """Right after a step is dispatched: every scheduled request has computed its tokens, and
        each one that sampled holds a pending token (the last one, if it reaches max_tokens or
        the context). A request that filled a page records it in the prefix cache, or, while
        the page's last token is still on the device, at the next `commit`. The decodes move on
        as arrays over their slots (one token each, or their steps in a multi-step dispatch;
        drafts count once verified, at `commit`); prompt chunks, a few, one by one."""
        counters, num_decodes, multi = self.counters, schedule.num_decodes, schedule.decode_steps > 1
        slots, columns = schedule.decode_slots, counters.values[:, schedule.decode_slots]
        steps = np.fromiter(schedule.num_tokens.values(), np.int64, num_decodes) if multi else 1
        live = columns[GENERATION] == schedule.decode_generations  # not ended since it was scheduled
        if not live.all():
            slots, columns, steps = slots[live], columns[:, live], steps[live] if multi else 1
        computed = columns[COMPUTED] + steps
        counters.num_computed_tokens[slots] = computed
        counters.num_pending_tokens[slots] = columns[PENDING_TOKENS] + steps
        counters.stopping[slots] = computed + 1 >= columns[MAX_TOKENS]  # all computed but the one sampled
        if self.blocks.enable_caching:  # the decodes that filled a page (a few a step)
            filled = np.flatnonzero(computed // self.blocks.page_size > columns[CACHED_PAGES])
            for request in counters.requests[slots[filled]].tolist():
                self._record_filled(schedule, request)
        for request, n in itertools.islice(schedule.num_tokens.items(), num_decodes, None):
            if request.status is not RequestStatus.RUNNING:
                continue
            computed = request.num_computed_tokens = request.num_computed_tokens + n
            if request in schedule.sampling:
                request.num_pending_tokens += 1
                request.stopping = computed + 1 >= request.max_num_tokens
            if self.prefix.behind(request):
                self._record_filled(schedule, request)

    def _record_filled(self, schedule: Schedule, request: Request) -> None:
        """Records in the prefix cache the pages a request's step filled, as far as its tokens are
        known on the host; the rest at the next `commit`."""
        schedule.cached_pages += self.prefix.record(request)  # forgotten if the step fails
        if self.prefix.behind(request):  # its last token is on the device: at the next commit
            self._unrecorded[request] = schedule

    def commit(self, schedule: Schedule, tokens: np.ndarray, logprobs: list[dict] | None = None,
               verified: dict[Request, tuple[list[int], list[dict] | None]] | None = None) -> list[Request]:
        """Once an advanced step's results are on the host: tokens[i] (and logprobs[i]) is what the
        i-th request of the schedule sampled, kept if it sampled; with several decode steps,
        tokens [steps, n] holds each step's, and a request keeps its first num_tokens[r] up to the
        one that ends it; a request with drafts, verified[r]: the tokens sampled after its last
        token and after each draft, and their logprobs (or None). Appends them, retires finished
        requests, and returns those.

        Most rows are decodes that append their one token and nothing else, as arrays over their
        slots and one append each; only those that sampled a token that ends some request, reach
        their length, sample their first token since admission, left their slot, run several
        steps, carry log-probabilities or drafts, and prompt chunks are looked at token by token
        (`_commit_row`)."""
        finished, now = [], self.clock()
        steps, sampling, counters = schedule.decode_steps, schedule.sampling, self.counters
        drawn = np.asarray(tokens).reshape(steps, -1)
        rows = range(drawn.shape[1])
        if steps == 1 and logprobs is None and not verified:
            slots, first = schedule.decode_slots, drawn[0, :schedule.num_decodes]
            columns = counters.values[:, slots]
            plain = ((columns[GENERATION] == schedule.decode_generations) & (columns[DECODING] > columns[STOPPING])
                     & ~self.stop_ids.among(first))
            rows = range(schedule.num_decodes, drawn.shape[1])  # and prompt chunks
            if not plain.all():
                rows = itertools.chain(np.flatnonzero(~plain).tolist(), rows)
                slots, first, columns = slots[plain], first[plain], columns[:, plain]
            counters.num_pending_tokens[slots] = columns[PENDING_TOKENS] - 1
            counters.last_token[slots] = first
            for output, token in zip(map(_output_of, counters.requests[slots].tolist()), first.tolist()):
                output.append(token)
        requests = list(schedule.num_tokens)
        for i in rows:
            request = requests[i]
            if request not in sampling:
                continue  # a prompt chunk that is not the last
            if request.finished:
                continue  # aborted meanwhile
            if verified and request in verified:
                if self._commit_verified(schedule, request, *verified[request], now):
                    finished.append(request)
                continue
            if self._commit_row(request, drawn[:schedule.num_tokens[request] if steps > 1 else 1, i].tolist(),
                                logprobs and logprobs[i], now):
                finished.append(request)
        for request, computed_by in list(self._unrecorded.items()):
            if not request.finished:  # that step may still be running: forgotten with it if it fails
                computed_by.cached_pages += self.prefix.record(request)
            if request.finished or not self.prefix.behind(request):
                del self._unrecorded[request]
        return finished

    def _commit_verified(self, schedule: Schedule, request: Request, sampled: list[int],
                         logprobs: list[dict] | None, now: float) -> bool:
        """A request's drafts against the tokens sampled after its last token and each draft (and
        their logprobs): the drafts equal to those are computed (their K/V written by this step),
        and it appends them and the token sampled after the last of them. Returns whether it ended."""
        drafts = schedule.drafts[request]
        kept = accepted(drafts, sampled)
        self.speculator.record(request, len(drafts), kept)
        request.num_computed_tokens += kept
        request.num_pending_tokens += kept
        request.stopping = request.num_computed_tokens + 1 >= request.max_num_tokens
        before = len(request.output_token_ids)
        ended = self._commit_row(request, sampled[:kept + 1], None, now)
        if logprobs:
            request.logprobs.extend(logprobs[:len(request.output_token_ids) - before])
        if ended:
            return True
        if self.blocks.enable_caching and \
                request.num_computed_tokens // self.blocks.page_size > request.num_cached_pages:
            schedule.cached_pages += self.prefix.record(request)
        return False

    def _commit_row(self, request: Request, tokens: list[int], logprobs: dict | None, now: float) -> bool:
        """Appends a request's tokens up to the one that ends it; returns whether one did."""
        if request.first_token_time is None:
            request.first_token_time = now
        stops = self.stop_ids.of(request)
        for token in tokens:
            request.num_pending_tokens -= 1
            request.output_token_ids.append(token)
            if logprobs:
                request.logprobs.append(logprobs)
            if token in stops:
                self.finish(request, FinishReason.STOP)
                return True
            if request.stopping and not request.num_pending_tokens:
                self.finish(request, FinishReason.LENGTH)
                return True
        if request.counters is not None:
            request.counters.commit_token(request, tokens[-1])
        return False

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Retires a request with `reason`, releasing its slot and pages."""
        if request.finished:
            return
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._release(request)
        self.stop_ids.remove(request)
        request.num_pending_tokens = 0  # a later step's token for it is dropped
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = self.clock()
