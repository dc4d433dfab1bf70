"""The engine core: schedule -> dispatch -> commit, one iteration per `step()`.

    step(): scheduler.schedule (grow pages / preempt, admit, fill the token budget: decodes first,
            then prompt chunks) -> build_step (flat ragged arrays) -> runner.dispatch (one compiled
            call) -> scheduler.advance (computed tokens, pending sampled ones)
            -> collect the previous step: its tokens to the host -> scheduler.commit (append, retire)
    With async scheduling the host schedules and dispatches step N+1 while the device runs step N;
    a token is pending (sampled, still on the device) for one step, and a request that stops on
    EOS or a stop token may compute one token too many, which is dropped.
    Structured output: a constrained request's grammar compiles beside the loop, the request held
    here (`compiling`) until it is ready and then queued; one that fails or takes too long ends
    with `error`. Before dispatch, the host fills the token bitmask of each constrained row
    that samples (GrammarMatchers.fill); once its token is on the host, the request's matcher
    consumes it, and a completed grammar ends the request. Its next mask needs that token, so a
    step that samples a constrained row is collected before the next one is scheduled (steps run
    in order while constrained rows sample; the others keep the overlap).

The core takes validated Requests (`input_processor`) and knows no text: stop strings and
detokenizing are the output processor's.

Failures end the requests they belong to with `error`, and the engine goes on: a request whose
scheduling raises (see `scheduler`), whose grammar's mask or matcher raises, ends alone. A step
that fails (at dispatch, or where its tokens are collected) ends the requests of the steps not yet
collected; the pages those steps put in the prefix cache, at dispatch or once a pending token
reached the host, lose their hashes (their K/V may never have been written), and a request that
took one as a prefix-cache hit meanwhile is recomputed. A pool the failure consumed or left in
error is replaced, and every running request is recomputed.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.batching import BlockManager, FinishReason, Request, Scheduler, SchedulerConfig, make_policy
from jaxserve.engine.batching.request import RequestStatus
from jaxserve.engine.batching.speculation import Speculator
from jaxserve.engine.batching.structured_outputs import short_error
from jaxserve.engine.draft_model import DraftModel
from jaxserve.engine.grammars import GrammarMatchers
from jaxserve.faults import faults
from jaxserve.model.config import ModelConfig
from jaxserve.worker.runner import Runner
from jaxserve.worker.sampling import STOP_IDS, SamplingBatch, sampling_mode
from jaxserve.worker.step_batch import StepBatch, StepSeqs, build_step

log = logging.getLogger(__name__)

HISTORY_STEPS = 2048  # steps kept in EngineCore.history (minutes of a busy engine)
_COMPILE_POLL_S = 0.005  # with only grammars compiling, how long a step waits for one


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One dispatched step, as the dashboard and benchmarks read it."""

    time: float  # time.time() at dispatch
    tokens: int  # tokens run (decode tokens plus prompt-chunk tokens)
    decode_rows: int  # sequences that decoded (one token each, or several in a multi-step dispatch)
    prefill_tokens: int  # tokens of prompt chunks
    running: int
    waiting: int
    used_pages: int
    cached_pages: int


class EngineCore:
    """A scheduler and its block manager for `config` over a runner's pool, with the grammar
    matchers of constrained requests."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, runner: Runner, max_model_len: int,
                 tokenizer=None, drafter: DraftModel | None = None):
        """`drafter`: the draft model, with speculative method "draft_model"."""
        budget = config.step_token_budget(max_model_len)
        if budget > runner.config.max_num_batched_tokens:
            raise ValueError(f"a step of {budget} tokens exceeds the compiled steps' "
                             f"{runner.config.max_num_batched_tokens}: build a new engine for this budget")
        self.config, self.runner, self.drafter = config, runner, drafter
        windows = runner.kv_groups.windows
        self.blocks = BlockManager(runner.config.num_pages, config.page_size, config.enable_prefix_caching,
                                   num_groups=len(windows))
        self.scheduler = Scheduler(
            SchedulerConfig(max_slots=config.max_slots, max_model_len=max_model_len, max_num_batched_tokens=budget,
                            enable_chunked_prefill=config.enable_chunked_prefill,
                            eos_token_ids=model_config.eos_token_ids, kv_group_windows=windows,
                            stop_ids_width=STOP_IDS),
            self.blocks,
            make_policy(config.strategy, batch_size=config.batch_size,
                        max_batch_delay_s=config.max_batch_delay_ms / 1000),
            speculator=Speculator(config.speculative, lambda r, drafts: self.grammars.valid_prefix(r.request_id, drafts))
            if config.speculative else None)
        self.grammars = GrammarMatchers(tokenizer, model_config.vocab_size, model_config.eos_token_ids)
        self.overlaps_steps = config.overlaps_steps  # asks the backend: once, not every step
        self.idle = True  # the last step had nothing to run
        self._in_flight = None  # the dispatched step whose tokens are not on the host yet
        self._sampling_mode = "greedy"  # the sample program every slot's parameters need
        self.compiling: dict[str, Request] = {}  # requests whose grammar compiles, by id, not queued yet
        self.num_errors = 0
        self.num_steps = 0
        self.history: collections.deque[StepRecord] = collections.deque(maxlen=HISTORY_STEPS)

    def add(self, request: Request) -> None:
        """Queues a validated request, or with a grammar starts compiling it: the request is
        queued once it is ready (ValueError at once if the model has no tokenizer)."""
        if request.params.structured_outputs is None:
            self.scheduler.add(request)
            return
        self.grammars.start(request.request_id, request.params.structured_outputs)
        self.compiling[request.request_id] = request

    def abort(self, request_id: str) -> None:
        """Ends a request with `abort` and frees its pages and grammar matcher (no-op if done)."""
        request = self.compiling.pop(request_id, None)
        if request is not None:
            _end_unqueued(request, FinishReason.ABORT, self.scheduler.clock())
        else:
            self.scheduler.abort(request_id)
        self.grammars.remove(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.compiling) or self.scheduler.has_unfinished()

    def _queue_compiled(self) -> list[Request]:
        """Queues the requests whose grammars are ready; returns those whose grammars failed,
        ended with `error`. With nothing else to run, first waits a little for a compile to end
        (the loop would only spin)."""
        idle = self._in_flight is None and not self.scheduler.has_unfinished()
        ready, failed = self.grammars.poll(timeout=_COMPILE_POLL_S if idle else 0.0)
        for request_id in ready:
            self.scheduler.add(self.compiling.pop(request_id))
        ended = []
        for request_id, why in failed.items():
            ended.append(request := self.compiling.pop(request_id))
            request.error = why
            _end_unqueued(request, FinishReason.ERROR, self.scheduler.clock())
        return ended

    def step(self) -> list[Request]:
        """One iteration: schedules and dispatches the next step, then collects the step before it
        (or, without async scheduling, this one). Returns the requests that finished."""
        if self.runner.pool_user is not self:
            self._take_pool()
        finished: list[Request] = self._queue_compiled() if self.compiling else []
        schedule = None
        try:
            schedule = self.scheduler.schedule()
            finished += schedule.failed
            launched = self._launch(schedule, finished) if not schedule.empty else None
            if self._in_flight is not None:
                finished += self._collect(*self._in_flight)
            self._in_flight = launched
            # A constrained row's next mask needs the token it just sampled, and a step with drafts
            # decides how far each of its sequences got: collect it now. So too while requests may
            # draft: a sequence with a token still on the device cannot draft after it.
            speculator = self.scheduler.speculator
            if launched is not None and (not self.overlaps_steps or launched[3] or launched[0].drafts or (
                    speculator is not None and speculator.drafting(self.scheduler.num_running))):
                self._in_flight = None
                finished += self._collect(*launched)
        except Exception:  # keep serving: the failed steps' requests end with `error`, the rest go on
            log.exception("engine step failed")
            self.num_errors += 1
            failed = ([schedule] if schedule else []) + ([self._in_flight[0]] if self._in_flight else [])
            self._in_flight = None
            for request in {r: None for s in failed for r in s.num_tokens}:
                if not request.finished:
                    self.scheduler.finish(request, FinishReason.ERROR)
                    finished.append(request)
            # Their K/V may never have been written, whether or not the pool survived.
            finished += self.scheduler.forget([p for s in failed for p in s.cached_pages])
            if self.drafter is not None:
                self.drafter.recover()
            if self.runner.recover():  # a zeroed pool: no computed token or cached page is in it any more
                finished += self.scheduler.preempt_all()
                self.blocks.reset_prefix_cache()
            else:  # the block-table entries this step carried may not have reached the device: send all again
                self.scheduler.table.write_all(self.scheduler.running)
        self.idle = (schedule is None or schedule.empty) and self._in_flight is None
        return finished

    def _take_pool(self) -> None:
        """Before this engine's first step since another engine over the same runner
        (`Engine.with_strategy`) ran one: that engine wrote its own K/V into pages this one's prefix
        cache may still name, and its own block tables and sampling parameters into the slots."""
        if self.runner.pool_user is not None:
            self.blocks.reset_prefix_cache()
            self.scheduler.table.write_all(self.scheduler.running)
        self.runner.pool_user = self

    def _launch(self, schedule, finished: list[Request]):
        """Builds and dispatches a step, and advances the scheduler past it. When every request
        decodes and none needs the host after each token, the step runs several decode steps.
        A request whose grammar's mask cannot be computed ends with `error` (into `finished`)."""
        steps = self.config.decode_steps
        if steps > 1 and schedule.num_decodes == len(schedule.num_tokens) and not self.scheduler.table.num_host_steps \
                and not schedule.drafts:
            self.scheduler.look_ahead(schedule, steps)
        if self.drafter is not None and schedule.drafts:
            self.drafter.propose(schedule.drafts, self.grammars)
            for request, drafted in list(schedule.drafts.items()):  # fewer where a grammar took no more
                schedule.num_tokens[request] = 1 + len(drafted)
                if not drafted:
                    del schedule.drafts[request]
        batch = self._build(schedule)
        constrained = [(i, r) for i, r in enumerate(schedule.num_tokens)  # no per-slot scan without grammars
                       if r in schedule.sampling and r.request_id in self.grammars] if len(self.grammars) else []
        if constrained:
            drafts = schedule.drafts
            batch.allowed, failed = self.grammars.fill([(r.request_id, int(batch.rows[i]), drafts.get(r, ()))
                                                        for i, r in constrained],
                                                       len(batch.sample_slots))
            for request_id in failed:  # ended before the step runs: it writes their freed pages, as after an abort
                request = next(r for _, r in constrained if r.request_id == request_id)
                request.error = "its grammar's token mask could not be computed"
                self.scheduler.finish(request, FinishReason.ERROR)
                finished.append(request)
        want_logprobs = (self.scheduler.table.num_host_steps > 0  # a request with logprobs is one of those
                         and any(r.params.logprobs is not None for r in schedule.sampling))
        in_flight = self.runner.dispatch(batch, logprobs=want_logprobs)
        self.scheduler.advance(schedule)
        self._record(schedule)
        return schedule, batch.rows, in_flight, constrained

    def _build(self, schedule) -> StepBatch:
        """The step's arrays, with the slot table's changes. Decodes come first (most rows: their
        one token is on the device unless steps run in order), their columns from the scheduler's
        arrays by slot; prompt chunks, a few, after them, from their requests."""
        requests = list(schedule.num_tokens)
        decodes, chunks = requests[:schedule.num_decodes], requests[schedule.num_decodes:]
        multi = schedule.decode_steps > 1  # num_tokens counts decode steps of one token each
        slots, (starts, token_ids) = schedule.decode_slots, self.scheduler.decode_inputs(schedule)
        drafts, sample_rows = schedule.drafts, None
        if drafts:  # a decode runs its drafts after its last token, each sampled after
            token_ids = np.array([t for r, t in zip(decodes, token_ids.tolist()) for t in [t, *drafts.get(r, ())]])
            sample_rows = np.array([1 + len(drafts.get(r, ())) for r in requests], np.int32)
        counts = np.fromiter(schedule.num_tokens.values(), np.int32, len(requests))
        samples = np.ones(len(requests), bool)
        if chunks:
            chunk_starts = [r.num_computed_tokens for r in chunks]
            slots = np.concatenate([slots, [r.slot for r in chunks]])
            starts = np.concatenate([starts, chunk_starts])
            token_ids = np.concatenate([token_ids, *(r.token_ids(start, start + schedule.num_tokens[r])
                                                     for r, start in zip(chunks, chunk_starts))])
            samples[len(decodes):] = [r in schedule.sampling for r in chunks]
        seqs = StepSeqs(slots.astype(np.int64), starts.astype(np.int32), np.ones_like(counts) if multi else counts,
                        token_ids.astype(np.int32), samples)
        table = self.scheduler.table
        changed = table.take_sampling_updates()
        updates = None
        if changed is not None:  # admissions and retirements: the mode is one that covers every slot
            params = SamplingBatch.from_table(table)
            self._sampling_mode = sampling_mode(params, self.runner.model_config.vocab_size)
            updates = changed, params.at(changed)
        return build_step(seqs, self.config.max_slots, self.config.page_size, self.runner.buckets,
                          self.runner.replicas, table.take_updates(), updates, self._sampling_mode,
                          counts if multi else None, sample_rows)

    def _record(self, schedule) -> None:
        total = schedule.total_tokens
        drafted = sum(map(len, schedule.drafts.values())) if schedule.drafts else 0
        prefill = total - schedule.num_decodes - drafted if schedule.decode_steps == 1 else 0
        self.num_steps += 1
        self.history.append(StepRecord(time.time(), total, schedule.num_decodes, prefill,
                                       self.scheduler.num_running, len(self.scheduler.waiting),
                                       self.blocks.used_pages, self.blocks.cached_pages))

    def _collect(self, schedule, rows, in_flight, constrained=()) -> list[Request]:
        """Brings a dispatched step's tokens to the host and commits them; the constrained
        requests' matchers consume theirs."""
        if faults.armed:
            for request in schedule.num_tokens:
                faults.check("device_step", request.request_id)
        out = self.runner.collect(in_flight)
        tokens = out.tokens[..., rows]  # [n], or [steps, n] for several decode steps
        live = [(i, r) for i, r in constrained if not r.finished]  # not aborted meanwhile
        logprobs = None if out.logprobs is None else _logprob_dicts(out.logprobs, rows, list(schedule.num_tokens))
        verified = None
        if schedule.drafts:  # the tokens sampled after a request's last token and after each of its drafts
            verified = {}
            for r, row in zip(schedule.num_tokens, rows.tolist()):
                if r in schedule.drafts:
                    span = np.arange(row, row + 1 + len(schedule.drafts[r]))
                    verified[r] = (out.tokens[span].tolist(), None if out.logprobs is None or r.params.logprobs is None
                                   else _logprob_dicts(out.logprobs, span, [r] * len(span)))
        # a request that drafted appends up to 1 + its drafts (steps with drafts run in order: no token pending)
        before = {r: len(r.output_token_ids) for _, r in live if verified and r in verified}
        finished = self.scheduler.commit(schedule, tokens, logprobs, verified)
        for i, request in live:
            appended = request.output_token_ids[before[request]:] if request in before else [int(tokens[i])]
            for n, token in enumerate(appended, 1):
                try:
                    ended = self._advance_grammar(request, token)
                except Exception:  # noqa: BLE001 — this request's matcher failed, not the step: it ends alone
                    log.exception("request %s: its grammar failed on token %d", request.request_id, token)
                    ended = not request.finished
                    if ended:
                        self.scheduler.finish(request, FinishReason.ERROR)
                if ended:
                    finished.append(request)
                if ended or self.grammars.done(request.request_id):
                    if n < len(appended):  # it ended inside the kept drafts: there, as it would have without them
                        request.keep_output(len(request.output_token_ids) - len(appended) + n)
                    break
        return finished

    def _advance_grammar(self, request: Request, token: int) -> bool:
        """Feeds a constrained request's sampled token to its matcher; ends the request when the
        grammar is complete (`stop`, also where the token reached max_tokens) or refuses the token
        (`error`). Returns whether it ended here."""
        request_id = request.request_id
        if not self.grammars.consume(request_id, token):
            why = self.grammars.error(request_id)
            log.error("request %s: the grammar refused token %d: %s", request_id, token, why)
            if request.finished:
                return False
            request.error = f"its grammar refused the next token: {short_error(why)}"
            self.scheduler.finish(request, FinishReason.ERROR)
            return True
        if not self.grammars.done(request_id):
            return False
        if request.finished:  # by EOS (already `stop`), or max_tokens on the token that completed it
            if request.finish_reason is FinishReason.LENGTH:
                request.finish_reason = FinishReason.STOP
            return False
        self.scheduler.finish(request, FinishReason.STOP)
        return True

    def kv_group_pages(self) -> list[dict]:
        """Per KV-cache group: its sliding window (None: full attention), and the pages its
        sequences read (used) and keep for the prefix cache (cached). Free pages belong to none."""
        return [{"window": window, "used_pages": used, "cached_pages": cached}
                for window, (used, cached) in zip(self.runner.kv_groups.windows,
                                                  map(self.blocks.group_pages, range(self.blocks.num_groups)))]

    def stats(self) -> dict:
        scheduler, blocks, runner = self.scheduler, self.blocks, self.runner
        speculator = scheduler.speculator
        return {
            "running": scheduler.num_running,
            "waiting": len(scheduler.waiting) + len(self.compiling),  # queued, or their grammars compiling
            "free_pages": blocks.free_pages,  # unreferenced, holding nothing reusable
            "cached_pages": blocks.cached_pages,  # unreferenced, holding a prefix-cache page
            "used_pages": blocks.used_pages,  # read by running requests
            "total_pages": blocks.total_pages,
            "kv_groups": self.kv_group_pages(),
            "prefix_cache_queries": scheduler.prefix_cache_queries,  # prompt tokens looked up
            "prefix_cache_hits": scheduler.prefix_cache_hits,  # of those, found in the cache
            "num_compiles": runner.num_compiles + (self.drafter.runner.num_compiles if self.drafter else 0),
            "tokens_run": runner.tokens_run,  # real tokens through the model
            "tokens_computed": runner.tokens_computed,  # the same with bucket padding
            "num_preemptions": scheduler.num_preemptions,
            "num_errors": self.num_errors,
            "num_steps": self.num_steps,
            "structured_output_mask_seconds": self.grammars.fill_seconds,  # host time filling token masks
            "structured_output_mask_steps": self.grammars.fill_steps,  # steps that filled one
            # speculative decoding (vLLM's names): drafts verified (one per request and step), their tokens, and those kept
            "spec_decode_num_drafts": speculator.num_drafts if speculator else 0,
            "spec_decode_num_draft_tokens": speculator.num_draft_tokens if speculator else 0,
            "spec_decode_num_accepted_tokens": speculator.num_accepted_tokens if speculator else 0,
        }


def _end_unqueued(request: Request, reason: FinishReason, now: float) -> None:
    """Ends a request the scheduler never held (its grammar was compiling): no slot, no page."""
    request.status, request.finish_reason, request.finish_time = RequestStatus.FINISHED, reason, now


def _logprob_dicts(logprobs, rows: np.ndarray, requests: list[Request]) -> list[dict]:
    chosen, top_ids, top_logp = logprobs
    out = []
    for i, r in zip(rows, requests):
        k = r.params.logprobs or 0
        out.append({"logprob": float(chosen[i]),
                    "top": [(int(t), float(lp)) for t, lp in zip(top_ids[i, :k], top_logp[i, :k])]})
    return out
