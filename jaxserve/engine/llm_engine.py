"""The engine: tokenizer, scheduler and runner wired into one loop.

    prompt -> tokenizer.encode -> Request -> scheduler.waiting
    step(): scheduler.schedule (grow pages / preempt, admit, fill the token budget: decodes first,
            then prompt chunks) -> build_step (flat ragged arrays) -> runner.dispatch (one compiled
            call) -> scheduler.advance (computed tokens, pending sampled ones)
            -> collect the previous step: its tokens to the host -> scheduler.commit (append, retire)
    With async scheduling the host schedules and dispatches step N+1 while the device runs step N;
    a token is pending (sampled, still on the device) for one step, and a request that stops on
    EOS or a stop token may compute one token too many, which is dropped.
    Structured output: before dispatch, the host fills the token bitmask of each constrained row
    that samples (GrammarMatchers.fill); once its token is on the host, the request's matcher
    consumes it, and a completed grammar ends the request. Its next mask needs that token, so a
    step that samples a constrained row is collected before the next one is scheduled (steps run
    in order while constrained rows sample; the others keep the overlap).
    finished Request -> RequestOutput (text decoded once, stop strings applied while streaming)

The engine is single-threaded: `generate` and `stream` drive `step` themselves; the server drives
it from one loop thread.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import random
import time
from fractions import Fraction
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.batching import (BlockManager, FinishReason, Request, RequestOutput, SamplingParams, Scheduler,
                               SchedulerConfig, make_policy)
from jaxserve.engine.batching.kv_cache_manager import pages_per_sequence
from jaxserve.engine.batching.sampling_params import MAX_LOGPROBS
from jaxserve.config import EngineConfig
from jaxserve.worker.dtype_plan import DtypePlan, plan_for
from jaxserve.errors import QueueFullError
from jaxserve.worker.kv_pool import pages_in_budget
from jaxserve.worker.machine import auto_kv_cache_bytes, auto_weights_dtype, bf16_dot_instructions
from jaxserve.model.config import ModelConfig
from jaxserve.model.kv_groups import kv_groups
from jaxserve.model.loader import cache_root, load_model
from jaxserve.model.transformer import Transformer
from jaxserve.engine.output_processor import OutputText
from jaxserve.pallas_kernels.backend import select_backend
from jaxserve.worker.runner import Runner, RunnerConfig
from jaxserve.worker.sampling import SamplingBatch
from jaxserve.worker.step_batch import ScheduledSeq, StepBuckets, build_step
from jaxserve.engine.grammars import GrammarMatchers
from jaxserve.distributed.sharding import canonical_sharding_for, kv_heads_per_memory, make_mesh
from jaxserve.tokenizer import DECODE_CONTEXT, Tokenizer, decode_after

log = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One dispatched step, as the dashboard and benchmarks read it."""

    time: float  # time.time() at dispatch
    tokens: int  # tokens run (decode tokens plus prompt-chunk tokens)
    decode_rows: int  # sequences that ran one token
    prefill_tokens: int  # tokens of prompt chunks
    running: int
    waiting: int
    used_pages: int
    cached_pages: int


HISTORY_STEPS = 2048  # steps kept in Engine.history (minutes of a busy engine)


class Engine:
    def __init__(self, model_config: ModelConfig, weights: dict[str, np.ndarray] | None, tokenizer: Tokenizer | None,
                 config: EngineConfig | None = None, model_name: str = "model", *, runner: Runner | None = None):
        """`runner`: another engine's runner (its model, compiled steps and KV pool) to schedule
        over instead of building one from `weights` (see `with_strategy`)."""
        config = config or EngineConfig()
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.model_name = model_name
        if config.max_model_len is not None and config.max_model_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's context "
                             f"({model_config.max_position_embeddings})")
        self.backend = select_backend(config.attention_backend)
        if runner is None:
            runner, self.kv_budget_reason, self.max_model_len_reason, self.weights_reason = self._build_runner(weights)
        else:
            self.kv_budget_reason = self.max_model_len_reason = self.weights_reason = "the engine it was made from"
        self.runner = runner
        self.max_model_len = runner.config.max_model_len
        self._reset_scheduler()

    def _build_runner(self, weights) -> tuple[Runner, str, str, str]:
        """The model on the device, then a KV pool in the memory it leaves, and their runner; with
        why the pool has its size, max_model_len its value, and the weights their dtype."""
        config, model_config = self.config, self.model_config
        model = Transformer(model_config, weights, jnp.dtype(config.weights_dtype))  # on the device now
        kv_bytes, reason = ((config.kv_cache_bytes, "asked for") if config.kv_cache_bytes
                            else auto_kv_cache_bytes(config.gpu_memory_utilization))
        mesh = make_mesh(config.mesh) if config.mesh else None
        heads = kv_heads_per_memory(mesh, model_config) if mesh else model_config.num_kv_heads
        share = Fraction(heads, model_config.num_kv_heads)  # of the pool's bytes, in the fullest memory
        if share != 1:
            reason += (f", held {share} times over in the host memory its devices share" if share > 1
                       else f", each device holding {share} of the pool")
        num_pages = config.num_pages or pages_in_budget(model_config, kv_bytes, config.page_size, config.kv_dtype,
                                                        heads)
        if num_pages < 2:
            raise ValueError(f"kv_cache_bytes={kv_bytes} holds no KV page")
        max_model_len, why = _resolve_max_model_len(config, model_config, num_pages)
        log.info("max_model_len %d (%s)", max_model_len, why)
        budget = config.step_token_budget(max_model_len)
        model, other, plan, weights_reason = self._dtype_per_program(model, weights, budget, mesh)
        runner = Runner(model, RunnerConfig(
            num_pages=num_pages, page_size=config.page_size, max_slots=config.max_slots,
            max_model_len=max_model_len, attention_backend=self.backend, max_num_batched_tokens=budget,
            num_logprobs=MAX_LOGPROBS, kv_dtype=config.kv_dtype, cache_dir=os.path.join(cache_root(), "compiled"),
            program_dtypes=plan.programs() if plan else (), min_rows=plan.min_rows if plan else None),
            mesh=mesh, other=other)
        return runner, reason, why, weights_reason

    def _dtype_per_program(self, model: Transformer, weights, budget: int, mesh
                           ) -> tuple[Transformer, Transformer | None, DtypePlan | None, str]:
        """(the runner's model, its copy in another dtype or None, the plan or None, why): with
        dtype="auto" on one CPU without bfloat16 dot instructions, each program's dtype as measured
        there (`jaxserve.worker.dtype_plan`); else every program in the loaded dtype."""
        config = self.config
        if config.dtype != "auto":
            return model, None, None, "asked for"
        reason = auto_weights_dtype()[1]
        if jax.default_backend() != "cpu" or mesh is not None or bf16_dot_instructions():
            return model, None, None, reason
        sizes = StepBuckets(max_tokens=budget, max_seqs=config.max_slots)
        plan = plan_for(self.model_config, sizes.token_sizes, sizes.row_sizes, config.weights_dtype,
                        os.path.join(cache_root(), "dtype_plans.json"))
        reason = f"{reason}; {plan.describe()}"
        log.info("weights %s: %s", "/".join(sorted(plan.dtypes())), reason)
        other = next((Transformer(self.model_config, weights, jnp.dtype(dtype))
                      for dtype in plan.dtypes() - {config.weights_dtype}), None)
        if config.weights_dtype not in plan.dtypes():  # every program in the other dtype
            return other, None, plan, reason
        return model, other, plan, reason

    def _reset_scheduler(self) -> None:
        """A fresh block manager and scheduler for `self.config` over the runner's pool."""
        config = self.config
        budget = config.step_token_budget(self.max_model_len)
        if budget > self.runner.config.max_num_batched_tokens:
            raise ValueError(f"a step of {budget} tokens exceeds the compiled steps' "
                             f"{self.runner.config.max_num_batched_tokens}: build a new engine for this budget")
        windows = self.runner.kv_groups.windows
        self.blocks = BlockManager(self.runner.config.num_pages, config.page_size, config.enable_prefix_caching,
                                   num_groups=len(windows))
        self.scheduler = Scheduler(
            SchedulerConfig(max_slots=config.max_slots, max_model_len=self.max_model_len,
                            max_num_batched_tokens=budget,
                            enable_chunked_prefill=config.enable_chunked_prefill,
                            eos_token_ids=self.model_config.eos_token_ids, kv_group_windows=windows),
            self.blocks,
            make_policy(config.strategy, batch_size=config.batch_size,
                        max_batch_delay_s=config.max_batch_delay_ms / 1000))
        self._requests: dict[str, Request] = {}
        self._texts: dict[str, OutputText] = {}  # requests with stop strings: their text, detokenized each step
        self._grammars = GrammarMatchers(self.tokenizer, self.model_config.vocab_size,
                                         self.model_config.eos_token_ids)  # structured output
        self.idle = True  # the last step had nothing to run
        self._in_flight = None  # the dispatched step whose tokens are not on the host yet
        self._seeds = random.Random(config.seed)
        self._ids = itertools.count()
        self._groups = itertools.count(1)
        self.num_errors = 0
        self.num_steps = 0
        self.history: collections.deque[StepRecord] = collections.deque(maxlen=HISTORY_STEPS)

    def with_strategy(self, strategy: str, **changes) -> "Engine":
        """A new engine with another batching strategy (and scheduling options such as batch_size or
        a smaller max_num_batched_tokens) over this one's runner: its model, compiled steps and KV
        pool. Benchmarks compare strategies and nothing else. Use one of the two at a time."""
        if self.has_unfinished():
            raise RuntimeError("with_strategy needs an idle engine")
        fixed = sorted(set(changes) & _RUNNER_FIELDS)
        if fixed:
            raise ValueError(f"with_strategy changes scheduling only: {', '.join(fixed)} need a new engine")
        return Engine(self.model_config, None, self.tokenizer, self.config.replace(strategy=strategy, **changes),
                      self.model_name, runner=self.runner)

    def warmup(self, progress: bool = False) -> int:
        """Compiles every program a step may run (every bucket, sampling with and without
        logprobs), or loads it from the compile cache (`$JAXSERVE_CACHE/compiled`), so that no
        request ever waits for a compile; returns how many were new. `progress`: a tqdm bar on
        stderr."""
        if not progress:
            return self.runner.warmup()
        from tqdm import tqdm
        with tqdm(total=len(self.runner.all_programs()), desc="compiling step programs", unit="program",
                  leave=False) as bar:
            return self.runner.warmup(lambda done, total: bar.update(1))

    def prepare_structured_output(self) -> None:
        """Builds llguidance's view of the tokenizer in a background thread (seconds for a large
        vocabulary), so that the first constrained request does not wait for it."""
        self._grammars.prepare()

    def describe(self) -> str:
        """What start-up resolved, one line each: backend, dtypes and why, KV pages, shapes."""
        config, runner = self.config, self.runner
        device = jax.devices()[0]
        pool_bytes = sum(x.nbytes for x in runner.kv_pool)
        buckets = runner.buckets
        return "\n".join([
            f"model {self.model_name}: {self.model_config.num_layers} layers, vocab {self.model_config.vocab_size}",
            f"backend {device.platform} ({jax.device_count()} x {device.device_kind}), attention {self.backend}",
            f"weights {'/'.join(sorted(runner.states))} ({self.weights_reason}); KV cache {config.kv_dtype}",
            f"KV pool {runner.config.num_pages} pages of {config.page_size} tokens, {pool_bytes / 2**30:.2f} GiB "
            f"({'num_pages asked for' if config.num_pages else self.kv_budget_reason}); "
            f"max_model_len {self.max_model_len} ({self.max_model_len_reason})",
            f"{len(runner.all_programs())} step programs: the layers per token bucket ({len(buckets.token_sizes)}, "
            f"up to {buckets.max_tokens} tokens), the output layer and sampling per row bucket "
            f"({len(buckets.row_sizes)}, up to {buckets.max_rows} sequences), from {buckets.min_rows} "
            f"row{'s (a one-row step is slower here than a two-row one)' if buckets.min_rows > 1 else ''}",
            f"async scheduling {'on' if config.overlaps_steps else 'off'}"
            f"{'' if config.async_scheduling is not None else ' (auto: on for accelerators only)'}",
            _describe_groups(runner.kv_groups),
        ])

    @classmethod
    def from_pretrained(cls, path: str | None = None, config: EngineConfig | None = None) -> "Engine":
        """Loads a Hugging Face checkpoint directory, a .gguf file, or (path=None) Gemma 3 270M.
        Call `warmup()` before serving, so that no request waits for a compile."""
        config = config or EngineConfig()
        # With a mesh, an Orbax checkpoint is restored straight into sharded arrays.
        sharding_for = (lambda cfg: canonical_sharding_for(make_mesh(config.mesh), cfg)) if config.mesh else None
        model_config, weights, tokenizer, name = load_model(path, config.weights_dtype, sharding_for)
        return cls(model_config, weights, tokenizer, config, model_name=name)

    # ---- submitting ----

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    group: int | None = None, arrival_time: float | None = None, cache_salt: str | None = None) -> str:
        """Validates and queues one prompt; returns its request id. Raises ValueError on bad input.
        `arrival_time` (time.monotonic) backdates a request that arrived while a step ran; requests
        with different `cache_salt`s never share prefix-cache pages."""
        params = params or SamplingParams()
        token_ids = self._validate(prompt, params)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        request = Request(request_id, token_ids, params, seed, arrival_time or time.monotonic(),
                          group=next(self._groups) if group is None else group, cache_salt=cache_salt)
        if params.structured_outputs is not None:  # compiled now: a grammar that fails queues nothing
            self._grammars.add(request_id, params.structured_outputs)
        self._requests[request_id] = request
        if params.stop:
            self._texts[request_id] = OutputText(self.tokenizer, token_ids, params.stop)
        self.scheduler.add(request)
        return request_id

    def _validate(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids instead of text")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            token_ids = [int(t) for t in prompt]
            if not token_ids:
                raise ValueError("prompt must not be empty")
            vocab = self.model_config.vocab_size
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; the context (max_model_len) is "
                             f"{self.max_model_len}, leaving no room to generate")
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                             f"context (max_model_len={self.max_model_len})")
        if any(t >= self.model_config.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be < vocab size {self.model_config.vocab_size}")
        return token_ids

    def abort(self, request_id: str) -> None:
        """Ends a request with finish reason `abort` and frees its pages and grammar matcher
        (no-op if already done)."""
        self.scheduler.abort(request_id)
        self._grammars.remove(request_id)

    # ---- running ----

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """One iteration: schedules and dispatches the next step, then collects the step before it
        (or, without async scheduling, this one). Returns the requests that finished."""
        finished: list[Request] = []
        schedule = self.scheduler.schedule()
        try:
            launched = self._launch(schedule) if not schedule.empty else None
            if self._in_flight is not None:
                finished += self._collect(*self._in_flight)
            self._in_flight = launched
            # A constrained row's next mask needs the token it just sampled: collect it now.
            if launched is not None and (not self.config.overlaps_steps or launched[3]):
                self._in_flight = None
                finished += self._collect(*launched)
        except Exception:  # keep serving: the failed steps' requests end with `error`, the rest go on
            log.exception("engine step failed")
            self.num_errors += 1
            failed = [schedule] + ([self._in_flight[0]] if self._in_flight else [])
            self._in_flight = None
            for request in {r: None for s in failed for r in s.num_tokens}:
                if not request.finished:
                    self.scheduler.finish(request, FinishReason.ERROR)
                    finished.append(request)
            if self.runner.recover():  # a zeroed pool: no computed token or cached page is in it any more
                finished += self.scheduler.preempt_all()
                self.blocks.reset_prefix_cache()
        self.idle = schedule.empty and self._in_flight is None
        finished += self._apply_stop_strings()
        return finished

    def _launch(self, schedule):
        """Builds and dispatches a step, and advances the scheduler past it."""
        seqs = [ScheduledSeq(r.slot, r.num_computed_tokens,
                             r.token_ids(r.num_computed_tokens, r.num_computed_tokens + n), schedule.samples(r))
                for r, n in schedule.num_tokens.items()]
        table = self.scheduler.table
        batch = build_step(seqs, table.block_tables, SamplingBatch.from_table(table), self.config.page_size,
                           self.runner.buckets, self.runner.replicas)
        constrained = [(i, r) for i, r in enumerate(schedule.num_tokens)  # no per-slot scan without grammars
                       if r in schedule.sampling and r.request_id in self._grammars] if len(self._grammars) else []
        if constrained:
            batch.allowed = self._grammars.fill([(r.request_id, int(batch.rows[i])) for i, r in constrained],
                                                len(batch.sample_slots))
        want_logprobs = any(r.params.logprobs is not None for r in schedule.sampling)
        in_flight = self.runner.dispatch(batch, logprobs=want_logprobs)
        self.scheduler.advance(schedule)
        self._record(schedule)
        return schedule, batch.rows, in_flight, constrained

    def _record(self, schedule) -> None:
        decodes = sum(1 for n in schedule.num_tokens.values() if n == 1)
        total = schedule.total_tokens
        self.num_steps += 1
        self.history.append(StepRecord(time.time(), total, decodes, total - decodes, len(self.scheduler.running),
                                       len(self.scheduler.waiting), self.blocks.used_pages, self.blocks.cached_pages))

    def _collect(self, schedule, rows, in_flight, constrained=()) -> list[Request]:
        """Brings a dispatched step's tokens to the host and commits them; the constrained
        requests' matchers consume theirs."""
        out = self.runner.collect(in_flight)
        requests = list(schedule.num_tokens)
        tokens = out.tokens[rows]
        live = [(i, r) for i, r in constrained if not r.finished]  # not aborted meanwhile
        finished = self.scheduler.commit(schedule, tokens, _logprob_dicts(out.logprobs, rows, requests))
        for i, request in live:
            if self._advance_grammar(request, int(tokens[i])):
                finished.append(request)
        return finished

    def _advance_grammar(self, request: Request, token: int) -> bool:
        """Feeds a constrained request's sampled token to its matcher; ends the request when the
        grammar is complete (`stop`, also where the token reached max_tokens) or refuses the token
        (`error`). Returns whether it ended here."""
        request_id = request.request_id
        if not self._grammars.consume(request_id, token):
            log.error("request %s: the grammar refused token %d: %s", request_id, token,
                      self._grammars.error(request_id))
            if request.finished:
                return False
            self.scheduler.finish(request, FinishReason.ERROR)
            return True
        if not self._grammars.done(request_id):
            return False
        if request.finished:  # by EOS (already `stop`), or max_tokens on the token that completed it
            if request.finish_reason is FinishReason.LENGTH:
                request.finish_reason = FinishReason.STOP
            return False
        self.scheduler.finish(request, FinishReason.STOP)
        return True

    def _apply_stop_strings(self) -> list[Request]:
        """Detokenizes the requests that have stop strings (only those: no per-slot work for the
        rest) and ends those whose text now holds one."""
        finished = []
        for request_id, text in self._texts.items():
            request = self._requests[request_id]
            if text.stopped or len(request.output_token_ids) == text.num_tokens:
                continue
            text.add(request.output_token_ids[text.num_tokens:])
            if text.stopped:
                if not request.finished:
                    self.scheduler.finish(request, FinishReason.STOP)
                    finished.append(request)
                elif request.finish_reason is FinishReason.LENGTH:
                    request.finish_reason = FinishReason.STOP  # the last token completed a stop string
        return finished

    # ---- results ----

    def request(self, request_id: str) -> Request:
        """The live Request of an id (KeyError once released)."""
        return self._requests[request_id]

    def output(self, request_id: str) -> RequestOutput:
        """The current state of a request as a RequestOutput."""
        r = self._requests[request_id]
        if r.request_id in self._texts and self._texts[r.request_id].stopped:
            text = self._texts[r.request_id].final_text
        else:
            text = self._decode_text(r)
        return RequestOutput(
            request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, token_ids=list(r.output_token_ids),
            text=text, finish_reason=r.finish_reason.value if r.finish_reason else None,
            ttft_s=None if r.first_token_time is None else r.first_token_time - r.arrival_time,
            latency_s=None if r.finish_time is None else r.finish_time - r.arrival_time,
            logprobs=list(r.logprobs) if r.params.logprobs is not None else None,
            num_cached_tokens=r.num_cached_tokens or 0)

    def _decode_text(self, r: Request) -> str:
        if self.tokenizer is None:
            return ""
        return decode_after(self.tokenizer, r.prompt_token_ids[-DECODE_CONTEXT:], r.output_token_ids)

    def release(self, request_id: str) -> None:
        """Forgets a finished request."""
        self._requests.pop(request_id, None)
        self._grammars.remove(request_id)
        self._texts.pop(request_id, None)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Runs prompts to completion (one payload: a static batch under `strategy="static"`)."""
        prompts = _as_prompt_list(prompts)
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        # Validate (and tokenize) all before queueing any.
        token_lists = [self._validate(prompt, p or SamplingParams()) for prompt, p in zip(prompts, params_list)]
        group = next(self._groups)
        ids: list[str] = []
        try:
            for tokens, p in zip(token_lists, params_list):
                ids.append(self.add_request(tokens, p, group=group, cache_salt=cache_salt))
        except Exception:  # e.g. a grammar that only fails against the tokenizer: queue none of them
            for i in ids:
                self.abort(i)
                self.release(i)
            raise
        self.run_until(lambda: all(self._requests[i].finished for i in ids))
        outputs = [self.output(i) for i in ids]
        for i in ids:
            self.release(i)
        return outputs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               cache_salt: str | None = None) -> Iterator[RequestOutput]:
        """Yields the request's state each time it gains tokens; the last one has a finish reason."""
        request_id = self.add_request(prompt, params, cache_salt=cache_salt)
        request = self._requests[request_id]
        seen = 0
        try:
            while True:
                if not request.finished:
                    self._step_or_wait()
                if len(request.output_token_ids) > seen or request.finished:
                    seen = len(request.output_token_ids)
                    yield self.output(request_id)
                if request.finished:
                    return
        finally:
            self.abort(request_id)
            self.release(request_id)

    def run_until(self, done) -> None:
        while not done():
            self._step_or_wait()

    def _step_or_wait(self) -> None:
        self.step()
        if self.idle and self.scheduler.waiting:
            time.sleep(0.0005)  # a dynamic batch is still filling: wait for its delay

    def kv_group_pages(self) -> list[dict]:
        """Per KV-cache group: its sliding window (None: full attention), and the pages its
        sequences read (used) and keep for the prefix cache (cached). Free pages belong to none."""
        return [{"window": window, "used_pages": used, "cached_pages": cached}
                for window, (used, cached) in zip(self.runner.kv_groups.windows,
                                                  map(self.blocks.group_pages, range(self.blocks.num_groups)))]

    def stats(self) -> dict:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "free_pages": self.blocks.free_pages,  # unreferenced, holding nothing reusable
            "cached_pages": self.blocks.cached_pages,  # unreferenced, holding a prefix-cache page
            "used_pages": self.blocks.used_pages,  # read by running requests
            "total_pages": self.blocks.total_pages,
            "kv_groups": self.kv_group_pages(),
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,  # prompt tokens looked up
            "prefix_cache_hits": self.scheduler.prefix_cache_hits,  # of those, found in the cache
            "num_compiles": self.runner.num_compiles,
            "tokens_run": self.runner.tokens_run,  # real tokens through the model
            "tokens_computed": self.runner.tokens_computed,  # the same with bucket padding
            "num_preemptions": self.scheduler.num_preemptions,
            "num_errors": self.num_errors,
            "num_steps": self.num_steps,
            "structured_output_mask_seconds": self._grammars.fill_seconds,  # host time filling token masks
            "structured_output_mask_steps": self._grammars.fill_steps,  # steps that filled one
        }


# What the runner's programs and pool are built from: an engine over another's runner keeps them.
_RUNNER_FIELDS = {"max_slots", "page_size", "num_pages", "kv_cache_bytes", "gpu_memory_utilization", "max_model_len",
                  "dtype", "kv_cache_dtype", "attention_backend", "mesh"}


def _describe_groups(groups) -> str:
    """One line, e.g. `KV-cache groups: 1 full attention, 5 sliding (window 512); 3 layers per page`."""
    kinds = collections.Counter(groups.windows)
    parts = [f"{n} full attention" if w is None else f"{n} sliding (window {w})" for w, n in kinds.items()]
    return f"KV-cache groups: {', '.join(parts)}; {groups.layers_per_page} layers per page"


def _resolve_max_model_len(config: EngineConfig, model_config: ModelConfig, num_pages: int) -> tuple[int, str]:
    """(max_model_len, why): as asked, if the pool holds one sequence of it (else ValueError);
    by default the model's context if the pool holds one, else the longest sequence it holds."""
    windows, context, usable = kv_groups(model_config).windows, model_config.max_position_embeddings, num_pages - 1

    def pages(length: int) -> int:
        return pages_per_sequence(windows, config.page_size, length, config.step_token_budget(length))

    def longest() -> int:  # pages() grows with the length
        lo, hi = 0, context
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if pages(mid) <= usable else (lo, mid - 1)
        return lo
    if config.max_model_len is not None:
        if pages(config.max_model_len) > usable:
            raise ValueError(f"max_model_len {config.max_model_len} does not fit the KV pool: one sequence of "
                             f"{config.max_model_len} tokens needs {pages(config.max_model_len)} pages, the pool "
                             f"has {usable}, which hold at most {longest()} tokens")
        return config.max_model_len, "asked for"
    if pages(context) <= usable:
        return context, "the model's context"
    length = longest()
    if length < 2:
        raise ValueError(f"the KV pool ({usable} pages) cannot hold a sequence of 2 tokens")
    return length, (f"the longest sequence the KV pool holds: the model's context of {context} tokens "
                    f"needs {pages(context)} pages, the pool has {usable}")


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, (int, np.integer)) for t in prompts):
        return [list(prompts)]  # one token-id prompt
    if isinstance(prompts, (list, tuple)) and prompts:
        return list(prompts)
    raise ValueError("prompts must be a string, a list of strings or a list of token-id lists, and not empty")


def _logprob_dicts(logprobs, rows: np.ndarray, requests: list[Request]) -> list[dict] | None:
    if logprobs is None:
        return None
    chosen, top_ids, top_logp = logprobs
    out = []
    for i, r in zip(rows, requests):
        k = r.params.logprobs or 0
        out.append({"logprob": float(chosen[i]),
                    "top": [(int(t), float(lp)) for t, lp in zip(top_ids[i, :k], top_logp[i, :k])]})
    return out
