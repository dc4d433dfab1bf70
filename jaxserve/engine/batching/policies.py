"""The five batching strategies, as admission rules over one scheduler.

Each policy answers one question every iteration: how many requests from the head of the waiting
queue may be admitted now? The scheduler then admits them in order while slots and pages allow.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from jaxserve.engine.batching.request import Request

STRATEGIES = ("none", "static", "dynamic", "continuous", "paged")


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base: admit everything that fits (continuous and paged differ only in page reservation)."""

    reserve_full_context: bool = False  # reserve pages for max_model_len at admission
    # Hold back a request whose prompt's next page another running request is computing, so a
    # shared prefix is computed once. Only for the policies that admit whatever fits: the others
    # promise that a batch starts together.
    waits_for_shared_prefix: bool = True

    def admissible(self, waiting: deque[Request], num_running: int, now: float) -> int:
        return len(waiting)


@dataclasses.dataclass(frozen=True)
class NoBatching(Policy):
    """One request at a time, in arrival order."""

    waits_for_shared_prefix: bool = False

    def admissible(self, waiting, num_running, now):
        return 0 if num_running else min(1, len(waiting))


@dataclasses.dataclass(frozen=True)
class StaticBatching(Policy):
    """A client payload runs as one batch to completion; nothing joins it."""

    waits_for_shared_prefix: bool = False

    def admissible(self, waiting, num_running, now):
        if num_running or not waiting:
            return 0
        group = waiting[0].group
        count = 0
        for request in waiting:
            if request.group != group:
                break
            count += 1
        return count


@dataclasses.dataclass(frozen=True)
class DynamicBatching(Policy):
    """A batch closes at `batch_size` requests or `max_batch_delay_s` after its first request,
    then runs to completion before the next one starts."""

    batch_size: int = 8
    max_batch_delay_s: float = 0.05
    waits_for_shared_prefix: bool = False

    def admissible(self, waiting, num_running, now):
        if num_running or not waiting:
            return 0
        if len(waiting) >= self.batch_size or now - waiting[0].arrival_time >= self.max_batch_delay_s:
            return min(len(waiting), self.batch_size)
        return 0


def make_policy(strategy: str, *, batch_size: int = 8, max_batch_delay_s: float = 0.05) -> Policy:
    """The policy object for a strategy name."""
    if strategy == "none":
        return NoBatching()
    if strategy == "static":
        return StaticBatching()
    if strategy == "dynamic":
        return DynamicBatching(batch_size=batch_size, max_batch_delay_s=max_batch_delay_s)
    if strategy == "continuous":
        return Policy(reserve_full_context=True)
    if strategy == "paged":
        return Policy()
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
