"""Iteration-level scheduler over a fixed number of batch slots.

Every step it (1) makes sure each running sequence has a page for its next token, preempting the
most recently admitted sequence when pages run out, then (2) admits waiting requests as the policy
allows while slots and pages last. After the runner has sampled, `update` appends the tokens and
retires finished sequences, freeing their slots and pages.

The slot table holds, per slot, what the runner needs as fixed-shape arrays: the last token, the
sequence length, the block table row and the sampling parameters.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections import deque
from typing import Callable, Iterable

import numpy as np

from jaxserve.batching.block_manager import BlockManager, pages_for
from jaxserve.batching.policies import Policy
from jaxserve.batching.request import FinishReason, Request, RequestStatus


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_slots: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class Schedule:
    """What to run this step: whole-sequence prefills for newly admitted (or resumed) requests,
    and one decode token for every other running sequence."""

    prefills: list[Request]
    decodes: list[Request]
    preempted: list[Request]

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class SlotTable:
    """Per-slot host arrays, in the fixed [max_slots] shape of the decode step."""

    def __init__(self, max_slots: int, pages_per_seq: int):
        self.tokens = np.zeros(max_slots, np.int32)  # last sampled token (not yet in the KV pool)
        self.lengths = np.zeros(max_slots, np.int32)  # tokens in the sequence; 0: free or awaiting prefill
        self.block_tables = np.zeros((max_slots, pages_per_seq), np.int32)  # 0: the null page
        self.temperature = np.zeros(max_slots, np.float32)
        self.top_k = np.zeros(max_slots, np.int32)
        self.top_p = np.ones(max_slots, np.float32)
        self.min_p = np.zeros(max_slots, np.float32)
        self.seed = np.zeros(max_slots, np.uint32)

    def fill(self, slot: int, request: Request) -> None:
        """Admission: sampling parameters and pages. The slot joins decode steps once its prefill
        has sampled a token (`Scheduler.update` sets its length)."""
        p = request.params
        self.temperature[slot], self.top_k[slot], self.top_p[slot], self.min_p[slot] = (
            p.temperature, p.top_k, p.top_p, p.min_p)
        self.seed[slot] = request.seed
        self.block_tables[slot, : len(request.pages)] = request.pages

    def clear(self, slot: int) -> None:
        self.block_tables[slot] = 0
        self.lengths[slot] = 0
        self.tokens[slot] = 0
        self.temperature[slot] = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, policy: Policy,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.blocks = blocks
        self.policy = policy
        self.clock = clock
        self.pages_per_seq = pages_for(config.max_model_len, blocks.page_size)
        self.table = SlotTable(config.max_slots, self.pages_per_seq)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._free_slots = list(range(config.max_slots))  # a heap: the lowest free slot first
        self.num_preemptions = 0

    # ---- queue ----

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Request | None:
        """Ends a waiting or running request with `abort`; returns it, or None if unknown."""
        for request in list(self.waiting) + self.running:
            if request.request_id == request_id:
                self.finish(request, FinishReason.ABORT)
                return request
        return None

    # ---- one iteration ----

    def schedule(self) -> Schedule:
        preempted = self._grow_running()
        prefills = [] if preempted else self._admit()
        fresh = set(prefills)  # Requests hash by identity
        decodes = [r for r in self.running if r not in fresh]
        return Schedule(prefills=prefills, decodes=decodes, preempted=preempted)

    def _grow_running(self) -> list[Request]:
        """Gives each running sequence the pages its next token needs; preempts when out."""
        preempted = []
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            needed = pages_for(request.num_tokens, self.blocks.page_size) - len(request.pages)
            while needed > 0 and not self.blocks.can_allocate(needed):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if needed > 0 and request.status is RequestStatus.RUNNING:
                self._add_pages(request, self.blocks.allocate(needed))
        return preempted

    def _admit(self) -> list[Request]:
        admitted = []
        budget = self.policy.admissible(self.waiting, len(self.running), self.clock())
        while budget > 0 and self.waiting and self._free_slots:
            request = self.waiting[0]
            tokens = self.config.max_model_len if self.policy.reserve_full_context else request.num_tokens
            needed = pages_for(tokens, self.blocks.page_size)
            if not self.blocks.can_allocate(needed):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.slot = heapq.heappop(self._free_slots)
            if request.admit_time is None:
                request.admit_time = self.clock()
            self.running.append(request)
            self._add_pages(request, self.blocks.allocate(needed))
            self.table.fill(request.slot, request)
            admitted.append(request)
            budget -= 1
        return admitted

    def _add_pages(self, request: Request, pages: list[int]) -> None:
        start = len(request.pages)
        request.pages.extend(pages)
        if request.slot is not None:
            self.table.block_tables[request.slot, start: start + len(pages)] = pages

    def _release(self, request: Request) -> None:
        if request.pages:
            self.blocks.free(request.pages)
            request.pages = []
        if request.slot is not None:
            self.table.clear(request.slot)
            heapq.heappush(self._free_slots, request.slot)
            request.slot = None
        if request in self.running:
            self.running.remove(request)

    def _preempt(self, request: Request) -> None:
        """Frees a running sequence's pages; it is recomputed from its tokens when readmitted."""
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- results ----

    def update(self, requests: Iterable[Request], tokens: np.ndarray,
               logprobs: list[dict] | None = None) -> list[Request]:
        """Appends one sampled token per request (tokens[i] for requests[i]); returns the finished."""
        finished = []
        now = self.clock()
        eos = self.config.eos_token_ids
        for i, request in enumerate(requests):
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            token = int(tokens[i])
            request.output_token_ids.append(token)
            if logprobs is not None:
                request.logprobs.append(logprobs[i])
            if request.first_token_time is None:
                request.first_token_time = now
            self.table.tokens[request.slot] = token
            self.table.lengths[request.slot] = request.num_tokens
            params = request.params
            if (token in params.stop_token_ids) or (not params.ignore_eos and token in eos):
                self.finish(request, FinishReason.STOP)
            elif len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
                self.finish(request, FinishReason.LENGTH)
            if request.finished:
                finished.append(request)
        return finished

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Retires a request with `reason`, releasing its slot and pages."""
        if request.finished:
            return
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = self.clock()
