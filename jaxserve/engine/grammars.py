"""The host side of structured output: one llguidance matcher per constrained request, and the
bitmask of the tokens each constrained row may sample next.

    add_request ─► GrammarMatchers.start: the spec's grammar compiles in a thread beside the engine
                   loop (ValueError at once only when the model has no tokenizer); the request
                   waits outside the scheduler, the others keep stepping. The compiled grammars of
                   the last GRAMMAR_CACHE specs are kept: the same grammar again is a copy of its
                   matcher (0.06 ms), not a compile
    each step ─► poll: the grammars compiled since (their requests join the queue), and those that
                 failed or ran past COMPILE_LIMIT_S (their requests end with `error`)
    each step that samples a constrained row:
        fill ─► int32 bitmask [R, ceil(V / 32)] (all bits set for every other row), filled in
                parallel across rows by llguidance's executor ─► StepBatch.allowed ─► the sampler
                (if that raises, row by row: a request whose row raises ends with `error`); a
                request with speculative drafts (cut by valid_prefix to what its grammar accepts)
                has a row per draft, masked as if the drafts before it had been consumed
        the sampled token comes back ─► consume ─► done (the grammar allows nothing but EOS): the
                                        request ends with `stop`
    release or abort ─► remove

A matcher's state is the output so far. Preemption recomputes the prompt and the output already
sampled, then samples the next token, so the matcher (which consumed that output) stays valid.
llguidance's tokenizer (a trie of every token's bytes) is built from the engine's tokenizer once
per tokenizer: when the first constrained request arrives, or ahead of it in a background thread
(`prepare`, which `jaxserve serve`'s engine process calls as its warm-up starts): for Gemma 3's
262k tokens, reading the tokenizer took about 5 s here and building the trie 4 s.
No jax here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
import weakref
from typing import Sequence

import numpy as np

from jaxserve.engine.batching.structured_outputs import StructuredOutputs, short_error
from jaxserve.faults import faults

log = logging.getLogger(__name__)

_BUILDS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()  # tokenizer -> builds
_BUILDS_LOCK = threading.Lock()
_EXECUTOR = None  # llguidance's thread pool, one per process
_COMPILERS = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxserve-grammar")  # idle: no threads
# A grammar still compiling after this long ends its request: llguidance's compile cannot be
# stopped, so its thread runs on, but nobody waits for it. Here a JSON schema of 1,000 enum
# properties compiled over Gemma 3's 262k tokens in 0.07 s (1.5 s beside a thread spinning in
# Python: the compile takes the GIL now and then, the loop is not held up by it).
COMPILE_LIMIT_S = 30.0
# Compiled grammars kept, the least recently asked for dropped first. Each request matches with a
# copy of one: for a JSON schema of 13,000 properties dropping the compiled grammar held the GIL
# for 21-23 ms (every stream waits), dropping a copy nothing; so that cost comes at eviction only.
GRAMMAR_CACHE = 16


class GrammarMatchers:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int] = ()):
        """`tokenizer`: a `jaxserve.tokenizer.Tokenizer` (or None: no structured output);
        `vocab_size`: the model's, which sets the mask's width."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.words = -(-vocab_size // 32)
        self._matchers: dict[str, object] = {}  # request id -> llguidance.LLMatcher
        self._compiling: dict[str, tuple[concurrent.futures.Future, float]] = {}  # -> (its compile, started)
        self._grammars: collections.OrderedDict = collections.OrderedDict()  # (field, grammar) -> its compile
        self.fill_seconds = 0.0  # host time spent filling masks, all steps together ...
        self.fill_steps = 0  # ... over this many steps

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def prepare(self) -> None:
        """Starts building llguidance's tokenizer in a background thread, so that the first
        constrained request does not wait seconds for it."""
        if self.tokenizer is not None:
            self._ll_tokenizer_future(background=True)

    @property
    def _ll_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer: this model has none")
        return self._ll_tokenizer_future(background=False).result()

    def _ll_tokenizer_future(self, background: bool) -> concurrent.futures.Future:
        """The build of llguidance's tokenizer, shared by every engine over the same tokenizer
        (`Engine.with_strategy`); run here, or in a thread of its own if `background`."""
        key = (self.vocab_size, tuple(self.eos_token_ids))
        with _BUILDS_LOCK:
            builds = _BUILDS.setdefault(self.tokenizer, {})
            future = builds.get(key)
            if future is None:
                future = builds[key] = concurrent.futures.Future()
                start = True
            else:
                start = False
        if start:
            def build():
                try:
                    future.set_result(self._build_ll_tokenizer())
                except BaseException as e:  # noqa: BLE001 — raised to whoever asks for it
                    future.set_exception(e)
            if background:
                threading.Thread(target=build, name="jaxserve-llguidance-tokenizer", daemon=True).start()
            else:
                build()
        return future

    def _build_ll_tokenizer(self):
        import llguidance
        if self.tokenizer.vocab_size > self.vocab_size:
            raise ValueError(f"structured_outputs: the tokenizer has {self.tokenizer.vocab_size} tokens, more than "
                             f"the model's {self.vocab_size}")
        return llguidance.LLTokenizer(self.tokenizer.to_str(), n_vocab=self.vocab_size,
                                      eos_token=self.eos_token_ids or None)

    @property
    def _executor(self):
        global _EXECUTOR
        if _EXECUTOR is None:
            import llguidance
            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR

    def add(self, request_id: str, spec: StructuredOutputs) -> None:
        """A matcher for a new request, compiled here; ValueError (naming the spec's field) if the
        grammar does not compile against this tokenizer."""
        self._matchers[request_id] = self._compiled(spec).result().deep_copy()

    def start(self, request_id: str, spec: StructuredOutputs) -> None:
        """Starts compiling a new request's matcher beside the caller; `poll` says when it is ready.
        ValueError at once if this model has no tokenizer."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer: this model has none")
        self._compiling[request_id] = (self._compiled(spec), time.monotonic())

    def _compiled(self, spec: StructuredOutputs) -> concurrent.futures.Future:
        """The compile of the spec's grammar: the one kept if it was asked for lately (done or
        still running), else a new one in a thread. Its result is the matcher requests copy."""
        key = (spec.field, spec.llguidance_grammar)  # the field: a failure's message names it
        future = self._grammars.pop(key, None) or _COMPILERS.submit(self._compile, spec)
        self._grammars[key] = future
        while len(self._grammars) > GRAMMAR_CACHE:
            self._grammars.popitem(last=False)
        return future

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def poll(self, timeout: float = 0.0) -> tuple[list[str], dict[str, str]]:
        """The requests whose grammars compiled since the last poll (their matchers ready), and
        those whose grammars failed or passed COMPILE_LIMIT_S, with why. Waits up to `timeout`
        seconds for one to end if none has."""
        if timeout and self._compiling:
            concurrent.futures.wait([f for f, _ in self._compiling.values()], timeout,
                                    concurrent.futures.FIRST_COMPLETED)
        ready, failed, now = [], {}, time.monotonic()
        for request_id, (future, started) in list(self._compiling.items()):
            if future.done():
                del self._compiling[request_id]
                try:
                    self._matchers[request_id] = future.result().deep_copy()
                    ready.append(request_id)
                except Exception as e:  # noqa: BLE001 — this request's grammar: it ends, with why
                    failed[request_id] = str(e)
            elif now - started > COMPILE_LIMIT_S:
                del self._compiling[request_id]
                failed[request_id] = f"its grammar took longer than {COMPILE_LIMIT_S:g} s to compile"
        for request_id, why in failed.items():
            log.error("request %s: %s; it ends with error", request_id, why)
        return ready, failed

    def _compile(self, spec: StructuredOutputs):
        import llguidance
        import llguidance.numpy as llnp
        matcher = llguidance.LLMatcher(self._ll_tokenizer, spec.llguidance_grammar, log_level=0)
        # The first mask here too, off the loop: the matcher keeps it until it consumes a token, so
        # the step that samples the first token does not compute it. For a large grammar it costs
        # the most (105 ms for 5,000 optional properties; the masks after it take under 1 ms).
        llnp.fill_next_token_bitmask(matcher, np.full((1, self.words), -1, np.int32), 0)
        if matcher.is_error():
            raise ValueError(f"{spec.field} is invalid: {short_error(matcher.get_error())}")
        return matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._compiling.pop(request_id, None)  # a compile still running finishes unread

    def fill(self, rows: Sequence[tuple[str, int, Sequence[int]]], num_rows: int) -> tuple[np.ndarray, list[str]]:
        """The bitmask [num_rows, M] of a step: for each (request id, i, drafts) in `rows`, row i
        holds the tokens that request may sample next, and rows i+1 ... i+len(drafts) those it may
        sample after each of its drafts in turn (its matcher is left as it was); every other row
        allows every token. And the ids of the requests whose mask could not be computed (logged;
        their rows allow every token)."""
        start = time.perf_counter()
        mask = np.full((num_rows, self.words), -1, np.int32)
        failed = []
        try:
            if faults.armed:
                for r, *_ in rows:
                    faults.check("grammar_mask", r)
            _fill(self._executor, [(self._matchers[r], i, drafts) for r, i, drafts in rows], mask)
        except Exception:  # noqa: BLE001 — find whose row it was: that request ends, the others keep their masks
            log.exception("filling the token masks of %d constrained rows failed: filling them one by one", len(rows))
            failed = self._fill_each(rows, mask)
        self.fill_seconds += time.perf_counter() - start
        self.fill_steps += 1
        return mask, failed

    def _fill_each(self, rows: Sequence[tuple[str, int, Sequence[int]]], mask: np.ndarray) -> list[str]:
        """Fills the rows one request at a time; returns the requests whose rows raised."""
        failed = []
        for r, i, drafts in rows:
            try:
                if faults.armed:
                    faults.check("grammar_mask", r)
                _fill(self._executor, [(self._matchers[r], i, drafts)], mask)
            except Exception:  # noqa: BLE001 — this request's grammar, not the step
                log.exception("request %s: its grammar's token mask failed: it ends with error", r)
                mask[i:i + 1 + len(drafts)] = -1
                failed.append(r)
        return failed

    def rollback(self, request_id: str, n: int) -> None:
        """Takes back the request's last `n` consumed tokens (drafts consumed to mask the next)."""
        if n:
            self._matchers[request_id].rollback(n)

    def valid_prefix(self, request_id: str, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the request's grammar accepts next (its matcher unchanged)."""
        return self._matchers[request_id].validate_tokens(list(tokens))

    def consume(self, request_id: str, token: int) -> bool:
        """Advances a request's matcher past its sampled token; False if the grammar refuses it
        (it cannot, when the token was drawn under the mask: a bug or a tokenizer mismatch)."""
        return self._matchers[request_id].consume_token(token)

    def done(self, request_id: str) -> bool:
        """Whether the request's grammar is complete: nothing may follow but EOS."""
        return self._matchers[request_id].is_stopped()

    def error(self, request_id: str) -> str:
        return self._matchers[request_id].get_error()


def _fill(executor, rows: Sequence[tuple[object, int, Sequence[int]]], mask: np.ndarray) -> None:
    """(matcher, row, drafts) masks into `mask`, in parallel: llguidance takes the rows without
    drafts and those with some in two calls."""
    import llguidance.numpy as llnp
    plain = [(matcher, i) for matcher, i, drafts in rows if not drafts]
    drafting = [(matcher, i, list(drafts)) for matcher, i, drafts in rows if drafts]
    if plain:
        llnp.fill_next_token_bitmask_par(executor, plain, mask)
    if drafting:
        llnp.fill_next_token_bitmask_par_with_draft_tokens(executor, drafting, mask)
