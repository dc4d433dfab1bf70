"""The compiled model step over the paged KV pool: one verb, `step` (or `dispatch` then
`collect`), for a ragged batch of decode tokens and prompt chunks. The runner computes and never
decides what runs.

Each step also keeps every sampling slot's token on the device (`slot_tokens`), and a token the
host does not have yet is read from there: so step N+1 can be dispatched before step N's tokens
reach the host, and the host's scheduling overlaps the device's work.

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
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import sharding
from jaxserve.kv_pool import allocate_kv_pool, storage_dtype
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
    kv_dtype: str = "float32"


@dataclasses.dataclass
class InFlight:
    """A dispatched step: its outputs still on the device, being copied to the host."""

    outputs: tuple
    logprobs: bool


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
        # On CPU the reference attention reads a bfloat16 pool kept as bits (see kv_pool).
        as_bits = config.attention_backend == "reference" and jax.default_backend() == "cpu"
        self.kv_dtype = storage_dtype(config.kv_dtype, as_bits)
        self.kv_pool = allocate_kv_pool(model.cfg, config.num_pages, config.page_size, self.kv_dtype, kv_sharding)
        self.slot_tokens = self._zeros_slot_tokens()  # [max_slots] each slot's last sampled token
        self.pages_per_seq = -(-config.max_model_len // config.page_size)
        # Each replica's slice is bucketed; a replica holds at most its share of the slots. XLA:CPU
        # runs a bfloat16 dot with one row 5-10x slower than with two, so no step has one row there.
        one_row_trap = jax.default_backend() == "cpu" and model.embed[...].dtype == jnp.bfloat16
        self.buckets = StepBuckets(max_tokens=config.max_num_batched_tokens,
                                   max_seqs=config.max_slots // self.replicas, min_rows=2 if one_row_trap else 1)
        self._compiled: dict[tuple, object] = {}
        self.tokens_run = 0  # real tokens through the model ...
        self.tokens_computed = 0  # ... and with bucket padding
        self._jitted = jax.jit(self._step, static_argnames=("logprobs",), donate_argnums=(1, 2))

    @property
    def num_compiles(self) -> int:
        return len(self._compiled)

    def step(self, batch: StepBatch, logprobs: bool = False) -> StepOutput:
        """Runs one ragged batch: writes every token's K/V, samples one token per sequence row."""
        return self.collect(self.dispatch(batch, logprobs))

    def dispatch(self, batch: StepBatch, logprobs: bool = False) -> InFlight:
        """Starts a step on the device and returns at once."""
        key = (batch.shape, logprobs)
        inputs = (batch.tokens, batch.token_slots, batch.meta, batch.logits_indices, batch.sampling,
                  batch.sample_slots)
        if self.mesh is not None:
            inputs = self._place(inputs)
        args = (self.state, self.kv_pool, self.slot_tokens, *inputs)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self._compile(args, logprobs)
        self.kv_pool, self.slot_tokens, out = compiled(*args)
        self.tokens_run += batch.num_tokens
        self.tokens_computed += batch.shape[0]
        for x in out:
            x.copy_to_host_async()
        return InFlight(out, logprobs)

    def collect(self, step: InFlight) -> StepOutput:
        """Waits for a dispatched step's sampled tokens (the one device-to-host transfer of a step)."""
        out = jax.device_get(step.outputs)
        return StepOutput(tokens=out[0], logprobs=out[1:] if step.logprobs else None)

    def _step(self, state, kv_pool, slot_tokens, tokens, token_slots, meta: StepMetadata, logits_indices,
              sampling: SamplingBatch, sample_slots, *, logprobs: bool):
        model = nnx.merge(self.graphdef, state)
        tokens = jnp.where(token_slots >= 0, slot_tokens[jnp.maximum(token_slots, 0)], tokens)
        logits, kv_pool = model(tokens, kv_pool, meta, attend=self.attend, logits_indices=logits_indices)
        next_tokens = sample(logits, sampling, positions=meta.kv_lens)
        slot_tokens = slot_tokens.at[sample_slots].set(next_tokens, mode="drop")
        if logprobs:
            return kv_pool, slot_tokens, (next_tokens, *token_logprobs(logits, next_tokens, self.config.num_logprobs))
        return kv_pool, slot_tokens, (next_tokens,)

    def _zeros_slot_tokens(self):
        zeros = np.zeros(self.config.max_slots, np.int32)
        return jnp.asarray(zeros) if self.mesh is None else sharding.place(zeros, sharding.replicated(self.mesh))

    def recover(self) -> None:
        """After a failed step, which may have consumed the donated pool: fresh state if so."""
        if any(k.is_deleted() or v.is_deleted() for k, v in self.kv_pool):
            self.kv_pool = allocate_kv_pool(self.model_config, self.config.num_pages, self.config.page_size,
                                            self.kv_dtype, self.kv_sharding)
        if self.slot_tokens.is_deleted():
            self.slot_tokens = self._zeros_slot_tokens()

    # ---- compilation ----

    def _compile(self, args, logprobs: bool):
        if self.mesh is None:
            return self._jitted.lower(*args, logprobs=logprobs).compile()
        # Explicit layouts: params and pool keep theirs (the donated pool comes back in place),
        # step inputs are split by replica, and the sampled tokens come back replicated.
        kv = [(self.kv_sharding, self.kv_sharding)] * len(self.kv_pool)
        inputs = jax.tree.map(lambda x: x.sharding, args[3:])
        replicated = sharding.replicated(self.mesh)
        step = jax.jit(functools.partial(self._step, logprobs=logprobs),
                       in_shardings=(self.param_shardings, kv, replicated, *inputs),
                       out_shardings=(kv, replicated, replicated), donate_argnums=(1, 2))
        return step.lower(*args).compile()

    def _place(self, inputs):
        """Host step inputs onto the mesh, split by replica."""
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
            self.step(StepBatch(zeros(r * tokens), zeros(r * tokens) - 1, meta, zeros(r * seqs), greedy,
                                np.full(r * seqs, self.config.max_slots, np.int32), zeros(0)))
        self.tokens_run, self.tokens_computed = counters  # warm-up steps are not work
        return self.num_compiles - before
