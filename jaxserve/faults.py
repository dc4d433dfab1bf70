"""Fault injection, for tests only: a named point raises `InjectedFault` for a chosen request, so
a test can check that the request fails alone and the engine goes on. Off unless a test arms it;
a point costs one attribute read when off (`if faults.armed:`). Nothing in the configuration, the
CLI or the API arms it. No imports: every layer, the jax-free ones too, may check a point.

    faults.arm("schedule", "req-1")  # every check of that point for req-1 raises, until ...
    faults.clear()

Points (where the check sits):
    schedule      the request's admission or page growth (`Scheduler._admit_one`, `_add_pages`)
    stop_strings  its pass for stop strings (`OutputProcessor.apply_stop_strings`)
    detokenize    the text of its RequestOutput (`OutputProcessor.output`)
    grammar_mask  its token mask for a step (`GrammarMatchers.fill`)
    device_step   a dispatched step that runs it fails where its tokens are collected, the KV pool
                  not consumed (`EngineCore._collect`)
    receive       the API process delivers its outputs (`Subscribers.deliver`)
"""

from __future__ import annotations

POINTS = frozenset({"schedule", "stop_strings", "detokenize", "grammar_mask", "device_step", "receive"})


class InjectedFault(RuntimeError):
    """Raised by an armed fault point."""


class Faults:
    def __init__(self):
        self.armed = False  # read at every point: True while any point is armed
        self._requests: dict[str, set[str]] = {}  # point -> the request ids it raises for

    def arm(self, point: str, request_id: str) -> None:
        if point not in POINTS:
            raise ValueError(f"unknown fault point {point!r}: one of {sorted(POINTS)}")
        self._requests.setdefault(point, set()).add(request_id)
        self.armed = True

    def clear(self) -> None:
        self._requests = {}
        self.armed = False

    def check(self, point: str, request_id: str) -> None:
        """Raises InjectedFault if `point` is armed for `request_id` (call under `if faults.armed:`)."""
        if request_id in self._requests.get(point, ()):
            raise InjectedFault(f"fault injected at {point} for request {request_id}")


faults = Faults()
