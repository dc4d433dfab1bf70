"""The running requests' step counters as arrays by slot, so that the scheduler schedules, advances
and commits a step's decodes with numpy operations over their slots, and Python runs only for the
few requests that cross a page, run a prompt chunk or end.

A request's `SlotCounter` attributes (computed and pending tokens, `stopping`, its tables' reach,
its cached pages, its next window drop) live here from its admission (`attach`) until it leaves
its slot (`detach`); the request reads and writes them through those attributes, so they have one
home at a time. Beside them, per slot:

  decoding      1 once it has committed a token since its admission: each step then runs its one
                last token (its uncomputed tokens are 1) until it stops
  last_token    its last token known on the host, the one a decode runs when none is pending
  generation    changes whenever a request enters or leaves the slot: a step's rows whose
                request has left since it was scheduled no longer match

Every column is a row of one int64 array [columns, slots] (booleans as 0 and 1), so a step reads
all of a batch's in one gather: numpy's cost per call, not per slot, is what a small batch pays.
`order` holds the held slots in admission order: it is where `Scheduler.running` comes from.
"""

from __future__ import annotations

import numpy as np

from jaxserve.engine.batching.request import Request

COUNTERS = ("num_computed_tokens", "num_pending_tokens", "num_table_tokens", "num_cached_pages",
            "next_window_drop", "stopping")
COLUMNS = COUNTERS + ("max_num_tokens", "last_token", "decoding", "generation")
COMPUTED, PENDING_TOKENS, TABLE_TOKENS, CACHED_PAGES, WINDOW_DROP, STOPPING, MAX_TOKENS, LAST_TOKEN, DECODING, \
    GENERATION = range(len(COLUMNS))


class SlotCounters:
    def __init__(self, max_slots: int):
        self.values = np.zeros((len(COLUMNS), max_slots), np.int64)
        for row, name in enumerate(COLUMNS):
            setattr(self, name, self.values[row])  # a view: writes land in `values`
        self.requests = np.full(max_slots, None, object)
        self.order = np.zeros(0, np.int64)

    def attach(self, request: Request) -> None:
        """Moves the counters of a request just given `request.slot` here."""
        slot = request.slot
        self.values[:len(COUNTERS), slot] = [getattr(request, name) for name in COUNTERS]
        self.max_num_tokens[slot] = request.max_num_tokens
        self.last_token[slot] = (request.output_token_ids or request.prompt_token_ids)[-1]
        self.decoding[slot] = 0
        self.generation[slot] += 1
        self.requests[slot] = request
        self.order = np.append(self.order, slot)
        request.counters = self

    def detach(self, request: Request) -> None:
        """Moves a request's counters back to it, before it leaves its slot."""
        slot, values = request.slot, {name: getattr(request, name) for name in COUNTERS}
        request.counters = None
        for name, value in values.items():
            setattr(request, name, value)
        self.generation[slot] += 1
        self.decoding[slot] = 0
        self.requests[slot] = None
        self.order = self.order[self.order != slot]

    def commit_token(self, request: Request, token: int) -> None:
        """A held request appended `token` and decodes on (`decoding`)."""
        self.last_token[request.slot] = token
        self.decoding[request.slot] = 1
