"""The engine as users drive it: `generate` and `stream` (or `add_request` / `step` / `abort`, as
the server's engine process does) over three parts, in vLLM V1's shape:

    prompt -> InputProcessor (validate, tokenize) -> Request -> EngineCore.add (grammar compiled)
    step(): EngineCore.step (schedule -> dispatch -> commit) -> OutputProcessor (stop strings)
    finished Request -> RequestOutput (text decoded once)

`resources.build_runner` sizes the model, the KV pool and the context for this machine. The
engine is single-threaded: `generate` and `stream` drive `step` themselves; the server drives it
from one loop thread.
"""

from __future__ import annotations

import logging
import time
from typing import Iterator, Sequence

import jax

from jaxserve.config import EngineConfig, SpeculativeConfig
from jaxserve.distributed.sharding import canonical_sharding_for, make_mesh
from jaxserve.engine.batching import Request, RequestOutput, SamplingParams
from jaxserve.engine.core import EngineCore
from jaxserve.engine.draft_model import DraftModel
from jaxserve.engine.input_processor import InputProcessor, Prompt, as_prompt_list
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.resources import INHERITED, build_runner, describe_groups
from jaxserve.errors import QueueFullError
from jaxserve.model.config import ModelConfig
from jaxserve.model.loader import load_model
from jaxserve.model.quantization import GROUPS
from jaxserve.pallas_kernels.backend import select_backend
from jaxserve.tokenizer import Tokenizer
from jaxserve.worker.runner import Runner

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model_config: ModelConfig, weights, tokenizer: Tokenizer | None,
                 config: EngineConfig | None = None, model_name: str = "model", *, runner: Runner | None = None,
                 drafter: DraftModel | None = None):
        """`weights`: the model's arrays by name (see `jaxserve.model.weights`). `runner`: another
        engine's runner (its model, compiled steps and KV pool) to schedule over instead of
        building one from `weights` (see `with_strategy`); `drafter`: its draft model, likewise."""
        config = config or EngineConfig()
        self.config, self.model_config, self.tokenizer, self.model_name = config, model_config, tokenizer, model_name
        if config.max_model_len is not None and config.max_model_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's context "
                             f"({model_config.max_position_embeddings})")
        self.backend = select_backend(config.attention_backend)
        drafts = config.speculative is not None and config.speculative.method == "draft_model" and drafter is None
        draft = DraftModel.read(config, model_config) if drafts else None  # before the pool, which counts it
        if runner is None:
            runner, self.reasons = build_runner(config, model_config, weights, self.backend, draft and draft[0],
                                                tokenizer)
        else:
            self.reasons = INHERITED
        self.runner = runner
        self.max_model_len = runner.config.max_model_len
        self.inputs = InputProcessor(tokenizer, model_config, self.max_model_len, config.seed)
        if draft is not None:
            drafter = DraftModel.load(config, draft, runner, self.backend)
        self.core = EngineCore(config, model_config, runner, self.max_model_len, tokenizer, drafter)
        self.outputs = OutputProcessor(tokenizer)
        self.scheduler, self.blocks = self.core.scheduler, self.core.blocks
        self._requests: dict[str, Request] = {}

    def with_strategy(self, strategy: str, **changes) -> "Engine":
        """A new engine with another batching strategy (and scheduling options such as batch_size or
        a smaller max_num_batched_tokens) over this one's runner: its model, compiled steps and KV
        pool. Benchmarks compare strategies and nothing else. Use one of the two at a time: each
        forgets its prefix cache when it steps after the other (that one wrote into the pages)."""
        if self.has_unfinished():
            raise RuntimeError("with_strategy needs an idle engine")
        fixed = sorted(set(changes) & _RUNNER_FIELDS)
        if fixed:
            raise ValueError(f"with_strategy changes scheduling only: {', '.join(fixed)} need a new engine")
        speculative = SpeculativeConfig.of(changes.get("speculative", self.config.speculative))
        if speculative is not None and speculative.num_speculative_tokens > self.runner.config.speculative_tokens:
            raise ValueError(f"{speculative.num_speculative_tokens} speculative tokens need a new engine: this one's "
                             f"steps sample at most {1 + self.runner.config.speculative_tokens} rows a sequence")
        drafter = self.core.drafter if speculative is not None and self.config.speculative is not None and \
            speculative.model == self.config.speculative.model else None
        return Engine(self.model_config, None, self.tokenizer, self.config.replace(strategy=strategy, **changes),
                      self.model_name, runner=self.runner, drafter=drafter)

    def warmup(self, progress: bool = False) -> int:
        """Compiles every program a step may run (every bucket, sampling with and without
        logprobs), or loads it from the compile cache (`$JAXSERVE_CACHE/compiled`), so that no
        request ever waits for a compile; returns how many were new. `progress`: a tqdm bar on
        stderr."""
        if self.core.drafter is not None:
            self.core.drafter.runner.warmup()
        if not progress:
            return self.runner.warmup()
        from tqdm import tqdm
        with tqdm(total=len(self.runner.all_programs()), desc="compiling step programs", unit="program",
                  leave=False) as bar:
            return self.runner.warmup(lambda done, total: bar.update(1))

    def prepare_structured_output(self) -> None:
        """Builds llguidance's view of the tokenizer in a background thread (seconds for a large
        vocabulary), so that the first constrained request does not wait for it."""
        self.core.grammars.prepare()

    def describe(self) -> str:
        """What start-up resolved, one line each: backend, dtypes and why, KV pages, shapes."""
        config, runner = self.config, self.runner
        device = jax.devices()[0]
        pools = [runner] + ([self.core.drafter.runner] if self.core.drafter else [])
        pool_bytes = sum(x.nbytes for r in pools for x in r.kv_pool)
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.states))
        quantized = "not quantized" if runner.quant is None else runner.quant.describe()
        buckets = runner.buckets
        return "\n".join([
            f"model {self.model_name}: {self.model_config.num_layers} layers, vocab {self.model_config.vocab_size}",
            f"backend {device.platform} ({jax.device_count()} x {device.device_kind}), attention {self.backend}"
            + (" (decode rows by a CPU kernel)" if runner.config.decode_kernel else ""),
            f"weights {'/'.join(sorted(runner.states))} ({self.reasons.weights}), {quantized} "
            f"({self.reasons.quantization}): {weight_bytes / 2**30:.2f} GiB; KV cache {config.kv_dtype}",
            f"KV pool {runner.config.num_pages} pages of {config.page_size} tokens, {pool_bytes / 2**30:.2f} GiB "
            f"{'(the draft model holding its own K/V in each) ' if self.core.drafter else ''}"
            f"({'num_pages asked for' if config.num_pages else self.reasons.kv_budget}); "
            f"max_model_len {self.max_model_len} ({self.reasons.max_model_len})",
            f"{len(runner.all_programs())} step programs: the layers per token bucket ({len(buckets.token_sizes)}, "
            f"up to {buckets.max_tokens} tokens), the output layer and sampling per row bucket and sampling mode "
            f"({len(buckets.row_sizes)}, up to {buckets.max_rows} sequences), from {buckets.min_rows} "
            f"row{'s (a one-row step is slower here than a two-row one)' if buckets.min_rows > 1 else ''}",
            f"async scheduling {'on' if config.overlaps_steps else 'off'}"
            f"{'' if config.async_scheduling is not None else ' (auto: on for accelerators only)'}",
            _describe_speculation(config.speculative),
            describe_groups(runner.kv_groups),
        ])

    @classmethod
    def from_pretrained(cls, path: str | None = None, config: EngineConfig | None = None) -> "Engine":
        """Loads a Hugging Face checkpoint directory, a .gguf file, or (path=None) Gemma 3 270M.
        Call `warmup()` before serving, so that no request waits for a compile."""
        config = config or EngineConfig()
        # With a mesh, an Orbax checkpoint is restored straight into sharded arrays.
        sharding_for = (lambda cfg: canonical_sharding_for(make_mesh(config.mesh), cfg)) if config.mesh else None
        # int8 asked for by name is loaded int8 (and kept so in the cache); "auto" decides on float weights
        quantization = config.quantization if config.quantization in GROUPS else None
        model_config, weights, tokenizer, name = load_model(path, config.weights_dtype, sharding_for, quantization)
        return cls(model_config, weights, tokenizer, config, model_name=name)

    # ---- submitting ----

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    group: int | None = None, arrival_time: float | None = None, cache_salt: str | None = None) -> str:
        """Validates and queues one prompt; returns its request id. Raises ValueError on bad input,
        QueueFullError past `max_waiting`. `arrival_time` (time.monotonic) backdates a request that
        arrived while a step ran; requests with different `cache_salt`s never share prefix-cache pages."""
        request = self.inputs.request(prompt, params, request_id, group, arrival_time, cache_salt)
        if len(self.scheduler.waiting) + len(self.core.compiling) >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.core.add(request)
        self._requests[request.request_id] = request
        self.outputs.add(request)
        return request.request_id

    def abort(self, request_id: str) -> None:
        """Ends a request with finish reason `abort` and frees its pages and grammar matcher
        (no-op if already done)."""
        self.core.abort(request_id)

    # ---- running ----

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[Request]:
        """One iteration of the core, then the stop strings. Returns the requests that finished."""
        finished = self.core.step()
        return finished + self.outputs.apply_stop_strings(self._requests, self.scheduler.finish)

    @property
    def idle(self) -> bool:
        """Whether the last step had nothing to run."""
        return self.core.idle

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @property
    def history(self):
        """The last steps (`core.StepRecord`), as the dashboard and benchmarks read them."""
        return self.core.history

    # ---- results ----

    def request(self, request_id: str) -> Request:
        """The live Request of an id (KeyError once released)."""
        return self._requests[request_id]

    def output(self, request_id: str) -> RequestOutput:
        """The current state of a request as a RequestOutput."""
        return self.outputs.output(self._requests[request_id], self.scheduler.finish)

    def release(self, request_id: str) -> None:
        """Forgets a finished request."""
        self._requests.pop(request_id, None)
        self.core.grammars.remove(request_id)
        self.outputs.release(request_id)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Runs prompts to completion (one payload: a static batch under `strategy="static"`)."""
        prompts = as_prompt_list(prompts)
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        # Validate (and tokenize) all before queueing any.
        token_lists = [self.inputs.token_ids(prompt, p or SamplingParams()) for prompt, p in zip(prompts, params_list)]
        group = self.inputs.new_group()
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
        return self.core.kv_group_pages()

    def stats(self) -> dict:
        return self.core.stats()


# What the runner's programs and pool are built from: an engine over another's runner keeps them.
_RUNNER_FIELDS = {"max_slots", "page_size", "num_pages", "kv_cache_bytes", "gpu_memory_utilization", "max_model_len",
                  "dtype", "kv_cache_dtype", "attention_backend", "mesh", "decode_steps"}


def _describe_speculation(spec) -> str:
    if spec is None:
        return "speculative decoding off"
    drafts = (f"the greedy tokens of {spec.model}" if spec.method == "draft_model" else
              f"lookup {spec.prompt_lookup_max}..{spec.prompt_lookup_min} tokens")
    return (f"speculative decoding: {spec.method}, up to {spec.num_speculative_tokens} drafts a step ({drafts}), "
            f"paused below {spec.min_acceptance:.0%} acceptance and past {spec.max_batch} running")
