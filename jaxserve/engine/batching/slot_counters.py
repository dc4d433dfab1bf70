"""The running requests' step counters as arrays by slot, so that the scheduler schedules, advances
and commits a step's decodes with numpy operations over their slots, and Python runs only for the
few requests that cross a page, run a prompt chunk or end.

A request's `SlotCounter` attributes (computed and pending tokens, `stopping`, its tables' reach,
its cached pages, its next window drop) live here from its admission (`attach`) until it leaves
its slot (`detach`); the request reads and writes them through those attributes, so they have one
home at a time. Beside them, per slot:

  decoding      it has committed a token since its admission, and is not done with its prompt
                otherwise: each step runs its one last token (its uncomputed tokens are 1)
  last_token    its last token known on the host, the one a decode runs when none is pending
  generation    changes whenever a request enters or leaves the slot: a step's rows whose
                request has left since it was scheduled no longer match
  admission     the order of admissions, which is the order of `Scheduler.running`
"""

from __future__ import annotations

import numpy as np

from jaxserve.engine.batching.request import Request

COUNTERS = ("num_computed_tokens", "num_pending_tokens", "num_table_tokens", "num_cached_pages",
            "next_window_drop", "stopping")


class SlotCounters:
    def __init__(self, max_slots: int):
        for name in COUNTERS:
            setattr(self, name, np.zeros(max_slots, bool if name == "stopping" else np.int64))
        self.max_num_tokens = np.zeros(max_slots, np.int64)
        self.last_token = np.zeros(max_slots, np.int64)
        self.decoding = np.zeros(max_slots, bool)
        self.generation = np.zeros(max_slots, np.int64)
        self.admission = np.zeros(max_slots, np.int64)
        self.requests = np.full(max_slots, None, object)
        self.held = np.zeros(max_slots, bool)
        self._admissions = 0

    def attach(self, request: Request) -> None:
        """Moves the counters of a request just given `request.slot` here."""
        slot = request.slot
        for name in COUNTERS:
            getattr(self, name)[slot] = getattr(request, name)
        self.max_num_tokens[slot] = request.max_num_tokens
        self.last_token[slot] = (request.output_token_ids or request.prompt_token_ids)[-1]
        self.decoding[slot] = False
        self.generation[slot] += 1
        self._admissions += 1
        self.admission[slot] = self._admissions
        self.requests[slot], self.held[slot] = request, True
        request.counters = self

    def detach(self, request: Request) -> None:
        """Moves a request's counters back to it, before it leaves its slot."""
        slot, values = request.slot, {name: getattr(request, name) for name in COUNTERS}
        request.counters = None
        for name, value in values.items():
            setattr(request, name, value)
        self.generation[slot] += 1
        self.requests[slot], self.held[slot], self.decoding[slot] = None, False, False

    def running_slots(self) -> np.ndarray:
        """The held slots in admission order (`Scheduler.running`'s)."""
        held = np.flatnonzero(self.held)
        return held[np.argsort(self.admission[held])]

    def commit_token(self, request: Request, token: int) -> None:
        """A held request appended `token` and decodes on (`decoding`)."""
        self.last_token[request.slot] = token
        self.decoding[request.slot] = True
