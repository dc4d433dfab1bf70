"""The compiled model step over the paged KV pool: one verb, `step`, for a ragged batch of decode
tokens and prompt chunks. The runner computes and never decides what runs.

The step is compiled ahead of time once per (token, sequence) bucket of `StepBuckets` and
counted, so a steady workload compiles nothing new. The KV pool is donated to each step and
updated in place; the only device-to-host transfer per step is the sampled tokens (plus
log-probabilities when a request asks for them). Under a device mesh, parameters and pool keep
their shardings, step inputs are split by data-parallel replica, and attention runs per shard.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx

from jaxserve import sharding
from jaxserve.kv_pool import allocate_kv_pool
from jaxserve.model.paged_attention import StepMetadata
from jaxserve.model.transformer import Transformer
from jaxserve.pallas_kernels.backend import attention_fn
from jaxserve.sampling import SamplingBatch, sample, token_logprobs
from jaxserve.step_batch import StepBatch, StepBuckets


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    num_pages: int
    page_size: int
    max_slots: int
    max_model_len: int
    max_num_batched_tokens: int  # the largest step
    attention_backend: str = "reference"  # "reference" or "pallas" (resolved from "auto" by the engine)
    num_logprobs: int = 5


@dataclasses.dataclass
class StepOutput:
    tokens: np.ndarray  # [R] int32, one per padded sequence row
    logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # chosen [R], top ids/logprobs [R, k]


class Runner:
    def __init__(self, model: Transformer, config: RunnerConfig, mesh=None):
        """`mesh` (from `jaxserve.sharding.make_mesh`): lay params, KV pool and step inputs out on it."""
        self.config = config
        self.model_config = model.cfg
        self.mesh = mesh
        self.graphdef, self.state = nnx.split(model)
        dtype = model.embed[...].dtype
        self.attend = attention_fn(config.attention_backend)
        self.replicas = 1
        kv_sharding = None
        if mesh is not None:
            self.replicas = sharding.check_replicas(mesh, config.max_slots)
            self.param_shardings = sharding.param_shardings(self.state, mesh, model.cfg)
            self.state = sharding.place_tree(self.state, self.param_shardings)
            kv_sharding = sharding.kv_pool_sharding(mesh, model.cfg)
            self.attend = sharding.per_shard_attention(self.attend, mesh, model.cfg)
        self.kv_sharding = kv_sharding
        self.kv_pool = allocate_kv_pool(model.cfg, config.num_pages, config.page_size, dtype, kv_sharding)
        self.pages_per_seq = -(-config.max_model_len // config.page_size)
        # Each replica's slice is bucketed; a replica holds at most its share of the slots.
        self.buckets = StepBuckets(max_tokens=config.max_num_batched_tokens,
                                   max_seqs=config.max_slots // self.replicas)
        self._compiled: dict[tuple, object] = {}
        self.tokens_run = 0  # real tokens through the model ...
        self.tokens_computed = 0  # ... and with bucket padding
        self._jitted = jax.jit(self._step, static_argnames=("logprobs",), donate_argnums=(1,))

    @property
    def num_compiles(self) -> int:
        return len(self._compiled)

    def step(self, batch: StepBatch, logprobs: bool = False) -> StepOutput:
        """Runs one ragged batch: writes every token's K/V, samples one token per sequence row."""
        key = (batch.shape, logprobs)
        inputs = (batch.tokens, batch.meta, batch.logits_indices, batch.sampling)
        if self.mesh is not None:
            inputs = self._place(inputs)
        args = (self.state, self.kv_pool, *inputs)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self._compile(args, logprobs)
        self.kv_pool, out = compiled(*args)
        self.tokens_run += batch.num_tokens
        self.tokens_computed += batch.shape[0]
        out = jax.device_get(out)  # the one device-to-host transfer of the step
        return StepOutput(tokens=out[0], logprobs=out[1:] if logprobs else None)

    def _step(self, state, kv_pool, tokens, meta: StepMetadata, logits_indices, sampling: SamplingBatch, *,
              logprobs: bool):
        model = nnx.merge(self.graphdef, state)
        logits, kv_pool = model(tokens, kv_pool, meta, attend=self.attend, logits_indices=logits_indices)
        next_tokens = sample(logits, sampling, positions=meta.kv_lens)
        if logprobs:
            return kv_pool, (next_tokens, *token_logprobs(logits, next_tokens, self.config.num_logprobs))
        return kv_pool, (next_tokens,)

    # ---- compilation ----

    def _compile(self, args, logprobs: bool):
        if self.mesh is None:
            return self._jitted.lower(*args, logprobs=logprobs).compile()
        # Explicit layouts: params and pool keep theirs (the donated pool comes back in place),
        # step inputs are split by replica, and the sampled tokens come back replicated.
        kv = [(self.kv_sharding, self.kv_sharding)] * len(self.kv_pool)
        inputs = jax.tree.map(lambda x: x.sharding, args[2:])
        step = jax.jit(functools.partial(self._step, logprobs=logprobs),
                       in_shardings=(self.param_shardings, kv, *inputs),
                       out_shardings=(kv, sharding.replicated(self.mesh)), donate_argnums=(1,))
        return step.lower(*args).compile()

    def _place(self, inputs):
        """Host step inputs onto the mesh, split by replica; re-places a pool that was allocated
        without the mesh (e.g. after a failed step)."""
        if self.kv_pool[0][0].sharding != self.kv_sharding:
            self.kv_pool = [(sharding.place(k, self.kv_sharding), sharding.place(v, self.kv_sharding))
                            for k, v in self.kv_pool]
        return jax.tree.map(lambda x: sharding.place(x, sharding.batch_sharding(self.mesh, np.shape(x))), inputs)

    def warmup(self) -> int:
        """Compiles every bucket ahead of time (padding only: the null page absorbs the writes);
        returns how many shapes were new."""
        before, counters = self.num_compiles, (self.tokens_run, self.tokens_computed)
        r = self.replicas
        for tokens, seqs in self.buckets.all_shapes():
            greedy = SamplingBatch(np.zeros(r * seqs, np.float32), np.zeros(r * seqs, np.int32),
                                   np.ones(r * seqs, np.float32), np.zeros(r * seqs, np.float32),
                                   np.zeros(r * seqs, np.uint32))
            zeros = lambda n: np.zeros(n, np.int32)  # noqa: E731
            meta = StepMetadata(positions=zeros(r * tokens), slot_mapping=zeros(r * tokens), kv_lens=zeros(r * seqs),
                                block_tables=np.zeros((r * seqs, self.pages_per_seq), np.int32),
                                query_start=zeros(r * (seqs + 1)), num_seqs=zeros(r))
            self.step(StepBatch(zeros(r * tokens), meta, zeros(r * seqs), greedy, zeros(0)))
        self.tokens_run, self.tokens_computed = counters  # warm-up steps are not work
        return self.num_compiles - before
