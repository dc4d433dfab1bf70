"""Speculative decoding's host side: n-gram drafts, and when to draft at all.

    schedule ─► Speculator.drafts(request, room): up to K tokens that followed the sequence's last
                n tokens (n from prompt_lookup_max down to prompt_lookup_min) where they last
                occurred in it before ─► the step runs [last token, drafts...] and samples a token
                after each of them (the sampler's keys are per position, so each is the token a
                step without drafts would sample there)
    commit ─► accepted(drafts, sampled): the drafts equal to the sampled token before them; the
              sequence keeps those and the one sampled after the last of them ─► record(...)

Acceptance is exact for greedy and for sampling alike: a draft is kept only where it is the token
the sequence would have sampled anyway, so speculation changes no output, only how many tokens a
step yields. A request with a grammar drafts only what its grammar accepts next, and each of its
rows is sampled under the grammar's mask after the drafts before it (grammars.py).

It pays when the drafts are right often enough: a request whose drafts were accepted less than
`min_acceptance` of the time (over its last drafts) stops drafting for `retry_steps` steps, and
none drafts while more than `max_batch` requests run.
Pure Python and numpy: no jax here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from jaxserve.engine.batching.request import Request

WINDOW = 32  # a request's last drafted tokens that its acceptance rate counts


def ngram_draft(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the last occurrence, before the end, of the sequence's last n
    tokens (the longest n from max_n down to min_n that occurred); [] when none did."""
    seq = np.asarray(tokens, np.int64)
    length = len(seq)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = seq[length - n:]
        # starts i < length - n of every window equal to the tail; the latest one wins
        windows = np.lib.stride_tricks.sliding_window_view(seq[:length - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return seq[start:start + k].tolist()
    return []


def accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts equal the token sampled at their position (sampled[j] is the token
    drawn after the step's j-th token: after the last token, then after each draft)."""
    n = 0
    while n < len(drafts) and drafts[n] == sampled[n]:
        n += 1
    return n


@dataclasses.dataclass
class _Record:
    drafted: list[int] = dataclasses.field(default_factory=list)  # per step it drafted: tokens drafted ...
    kept: list[int] = dataclasses.field(default_factory=list)  # ... and accepted
    paused_until: int = 0  # the step from which it may draft again


class Speculator:
    def __init__(self, config, grammar_prefix: Callable[[Request, list[int]], int] = lambda request, drafts: 0):
        """`config`: a `jaxserve.config.SpeculativeConfig`; `grammar_prefix(request, drafts)`: how
        many leading drafts a request with a grammar may have (those its grammar accepts next)."""
        self.config = config
        self.grammar_prefix = grammar_prefix
        self.k = config.num_speculative_tokens
        self.step = 0
        self._records: dict[Request, _Record] = {}
        self.num_drafts = 0  # steps' worth of drafts proposed (one per request and step)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def new_step(self, running: int) -> bool:
        """Counts a step; whether requests may draft in it (not past `max_batch` running)."""
        self.step += 1
        return self.drafting(running)

    def drafting(self, running: int) -> bool:
        """Whether requests may draft with `running` requests running."""
        return running <= self.config.max_batch

    def drafts(self, request: Request, room: int) -> list[int]:
        """Up to min(K, room) draft tokens for a decoding request, or [] (none found, or paused).
        With a draft model, min(K, room) places for its tokens (`jaxserve.engine.draft_model`)."""
        record = self._records.get(request)
        if record is not None and self.step < record.paused_until:
            return []
        k = min(self.k, room)
        if k <= 0:
            return []
        c = self.config
        if c.method == "draft_model":  # reserved here, drawn by the draft model before the step is built
            return [0] * k
        drafts = ngram_draft(request.prompt_token_ids + request.output_token_ids, k, c.prompt_lookup_min,
                             c.prompt_lookup_max)
        if drafts and request.params.structured_outputs is not None:
            drafts = drafts[:self.grammar_prefix(request, drafts)]
        return drafts

    def record(self, request: Request, drafted: int, kept: int) -> None:
        """A step verified `drafted` drafts of the request and accepted `kept`; past WINDOW drafted
        tokens below min_acceptance, its drafting pauses."""
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += kept
        record = self._records.setdefault(request, _Record())
        record.drafted.append(drafted)
        record.kept.append(kept)
        while sum(record.drafted) - record.drafted[0] >= WINDOW:
            record.drafted.pop(0)
            record.kept.pop(0)
        total = sum(record.drafted)
        if total >= WINDOW and sum(record.kept) < self.config.min_acceptance * total:
            record.paused_until = self.step + self.config.retry_steps
            record.drafted.clear()
            record.kept.clear()

    def forget(self, request: Request) -> None:
        self._records.pop(request, None)
