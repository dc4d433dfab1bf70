"""Per-slot sampling parameters and stop ids (host arrays), and what changed since the runner last
took it: the block-table entries written and the slots whose parameters changed. The runner keeps
both tables on the device and applies the changes with the next step."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxserve.engine.batching.request import Request


class SlotTable:
    """Per-slot sampling parameters (host arrays), and what changed since the runner last took it:
    the block-table entries written (`take_updates`) and the slots whose sampling parameters
    changed (`take_sampling_updates`). The runner keeps both tables on the device and applies
    these changes with the next step."""

    def __init__(self, max_slots: int, eos_token_ids: Sequence[int] = (), stop_ids_width: int = 8):
        self._updates: list[tuple[int, int, int, int]] = []  # (slot, group, index, page)
        self._sampling_changed: set[int] = set()
        self.eos_token_ids = tuple(eos_token_ids)
        self.temperature = np.zeros(max_slots, np.float32)
        self.top_k = np.zeros(max_slots, np.int32)
        self.top_p = np.ones(max_slots, np.float32)
        self.min_p = np.zeros(max_slots, np.float32)
        self.seed = np.zeros(max_slots, np.uint32)
        self.stop_ids = np.full((max_slots, stop_ids_width), -1, np.int32)  # EOS unless ignored, stop token ids
        self.host_steps = np.zeros(max_slots, bool)  # whose request needs the host after every token
        self.num_host_steps = 0  # slots that do

    def fill(self, slot: int, request: Request) -> None:
        p = request.params
        self.temperature[slot], self.top_k[slot], self.top_p[slot], self.min_p[slot] = (
            p.temperature, p.top_k, p.top_p, p.min_p)
        self.seed[slot] = request.seed
        stops = p.stop_token_ids + (() if p.ignore_eos else self.eos_token_ids)
        self.stop_ids[slot] = -1
        self.stop_ids[slot, : min(len(stops), self.stop_ids.shape[1])] = stops[: self.stop_ids.shape[1]]
        # Checked on the host token by token: log-probabilities, stop strings, grammars, and stop ids
        # past what the device keeps. A request with any of them runs single steps.
        host = (p.logprobs is not None or bool(p.stop) or p.structured_outputs is not None
                or len(stops) > self.stop_ids.shape[1])
        self.num_host_steps += int(host) - int(self.host_steps[slot])
        self.host_steps[slot] = host
        self._sampling_changed.add(slot)
        self.write_pages(slot, request)

    def write_pages(self, slot: int, request: Request, start: Sequence[int] | None = None) -> None:
        """Records the entries of the request's block tables from `start[g]` in each group g on (all
        of them by default)."""
        for g, pages in enumerate(request.pages):
            first = start[g] if start else 0
            self._updates.extend((slot, g, i, page) for i, page in enumerate(pages[first:], first))

    def write_entries(self, slots: np.ndarray, group: int, indices: np.ndarray, pages: Sequence[int]) -> None:
        """Records entry indices[i] of group `group` in slots[i]'s tables as pages[i]."""
        self._updates.extend(zip(slots.tolist(), [group] * len(pages), indices.tolist(), pages))

    def write_null(self, slot: int, entries: Sequence[tuple[int, int]]) -> None:
        """Records (group, index) entries that became the null page."""
        self._updates.extend((slot, g, i, 0) for g, i in entries)

    def write_all(self, requests: Sequence[Request]) -> None:
        """Records every entry of the requests' block tables and their sampling parameters again
        (after a failed step, whose changes may not have reached the device)."""
        for request in requests:
            self.write_pages(request.slot, request)
            self._sampling_changed.add(request.slot)

    def take_updates(self) -> np.ndarray:
        """[n, 4] int32 (slot, group, index, page): the entries recorded since the last call, in order."""
        updates, self._updates = np.array(self._updates, np.int32).reshape(-1, 4), []
        return updates

    def take_sampling_updates(self) -> np.ndarray | None:
        """The slots [m] (int32, ascending) whose sampling parameters changed since the last call;
        None if none did (most steps)."""
        if not self._sampling_changed:
            return None
        slots, self._sampling_changed = np.array(sorted(self._sampling_changed), np.int32), set()
        return slots

    def clear(self, slot: int) -> None:
        """A freed slot's sampling parameters back to greedy. Its block-table entries stay: a step
        reads none past a sequence's length, and the next request in the slot writes its own."""
        self.temperature[slot], self.top_k[slot], self.top_p[slot], self.min_p[slot] = 0, 0, 1, 0
        self.stop_ids[slot] = -1
        self.num_host_steps -= int(self.host_steps[slot])
        self.host_steps[slot] = False
        self._sampling_changed.add(slot)
