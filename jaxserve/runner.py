"""Compiled model steps over the paged KV pool: `prefill` for newly admitted sequences, `decode`
for one token of every slot. The runner computes and never decides what runs.

Every step is compiled ahead of time once per shape bucket and counted: prefill per
(batch, length) bucket, decode per block-table width bucket (pages actually in use, rounded up to
a power of two), so a steady workload compiles nothing new. The KV pool is donated to each step and
updated in place; the only device-to-host transfer per step is the sampled tokens (plus
log-probabilities when a request asks for them).
Legend: B batch, T tokens, P pages per sequence, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import sharding
from jaxserve.kv_pool import allocate_kv_pool
from jaxserve.model.transformer import Transformer
from jaxserve.sampling import SamplingBatch, sample, token_logprobs


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    num_pages: int
    page_size: int
    max_slots: int
    max_model_len: int
    attention_backend: str = "reference"  # "reference" or "pallas" (resolved from "auto" by the engine)
    max_prefill_batch: int = 8
    max_prefill_tokens: int = 4096
    num_logprobs: int = 5


@dataclasses.dataclass
class StepOutput:
    tokens: np.ndarray  # [B] int32
    logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # chosen [B], top ids/logprobs [B, k]


def powers_of_two(low: int, high: int, factor: int = 2) -> list[int]:
    """low, 2 low, 4 low, ... (or another factor) and finally high itself."""
    sizes = []
    size = low
    while size < high:
        sizes.append(size)
        size *= factor
    return sizes + [high]


def bucket(value: int, sizes: list[int]) -> int:
    """The smallest size >= value."""
    for size in sizes:
        if size >= value:
            return size
    raise ValueError(f"{value} exceeds the largest bucket {sizes[-1]}")


class Runner:
    def __init__(self, model: Transformer, config: RunnerConfig, kv_sharding=None, mesh=None):
        """`mesh` (from `jaxserve.sharding.make_mesh`): lay params, KV pool and step inputs out on it."""
        self.config = config
        self.model_config = model.cfg
        self.mesh = mesh
        self.graphdef, self.state = nnx.split(model)
        dtype = model.embed[...].dtype
        if mesh is not None:
            sharding.check_decode_batch(mesh, config.max_slots)
            self.param_shardings = sharding.param_shardings(self.state, mesh, model.cfg)
            self.state = sharding.place_tree(self.state, self.param_shardings)
            kv_sharding = sharding.kv_pool_sharding(mesh, model.cfg)
            if mesh.size > 1 and config.attention_backend == "pallas":
                # GSPMD cannot split a Pallas custom call: it would gather the whole pool per device.
                config = self.config = dataclasses.replace(config, attention_backend="reference")
        self.kv_sharding = kv_sharding
        self.kv_pool = allocate_kv_pool(model.cfg, config.num_pages, config.page_size, dtype, kv_sharding)
        self.pages_per_seq = -(-config.max_model_len // config.page_size)
        self.length_buckets = powers_of_two(min(16, config.max_model_len), config.max_model_len)
        # Attention gathers every page up to the width: past 4 pages, step by 4 pages rather than
        # doubling, so the longest live sequence decides the cost, not the next power of two.
        self.width_buckets = sorted(set(powers_of_two(1, min(4, self.pages_per_seq))
                                        + list(range(4, self.pages_per_seq, 4)) + [self.pages_per_seq]))
        # Decode runs on the lowest slots that cover every live one (the scheduler fills low slots
        # first), so a half-empty batch costs half. A mesh splits slots over replicas: all of them.
        self.slot_buckets = [config.max_slots] if mesh is not None else powers_of_two(1, config.max_slots, factor=4)
        self._compiled: dict[tuple, object] = {}
        self._jitted = jax.jit(self._step, static_argnames=("decode", "logprobs"), donate_argnums=(1,))

    @property
    def num_compiles(self) -> int:
        return len(self._compiled)

    def prefill_batch_size(self, length_bucket: int) -> int:
        """Largest batch for a prompt length bucket within the prefill token budget."""
        size = 1
        while size * 2 <= self.config.max_prefill_batch and size * 2 * length_bucket <= self.config.max_prefill_tokens:
            size *= 2
        return size

    # ---- the two verbs ----

    def prefill(self, token_lists: list[list[int]], block_rows: np.ndarray, sampling: SamplingBatch,
                logprobs: bool = False) -> StepOutput:
        """Runs whole sequences from position 0, writes their K/V and samples each one's next token.

        token_lists: B sequences (at most the bucket's batch size); block_rows: [B, >= pages needed].
        """
        n = len(token_lists)
        longest = max(len(t) for t in token_lists)
        t_bucket = bucket(longest, self.length_buckets)
        b_bucket = bucket(n, powers_of_two(1, self.prefill_batch_size(t_bucket)))
        width = -(-t_bucket // self.config.page_size)
        tokens = np.zeros((b_bucket, t_bucket), np.int32)
        lengths = np.zeros(b_bucket, np.int32)
        tables = np.zeros((b_bucket, width), np.int32)
        for i, seq in enumerate(token_lists):
            tokens[i, : len(seq)] = seq
            lengths[i] = len(seq)
        tables[:n] = block_rows[:n, :width]
        out = self._run(False, logprobs, tokens, lengths, tables, _pad_sampling(sampling, b_bucket))
        return _take(out, n)

    def decode(self, tokens: np.ndarray, lengths: np.ndarray, block_tables: np.ndarray,
               sampling: SamplingBatch, logprobs: bool = False) -> StepOutput:
        """One token for every live slot. tokens, lengths: [max_slots] (length 0 marks a free slot);
        block_tables: [max_slots, pages_per_seq]. Returns tokens for the first slots (a bucket
        covering every live slot)."""
        live = np.flatnonzero(lengths)
        n = bucket(int(live[-1]) + 1 if len(live) else 1, self.slot_buckets)
        width = bucket(max(1, -(-int(lengths.max()) // self.config.page_size)), self.width_buckets)
        rows = jax.tree.map(lambda a: a[:n], sampling)
        return self._run(True, logprobs, tokens[:n, None], lengths[:n], block_tables[:n, :width], rows)

    # ---- compilation ----

    def _run(self, decode: bool, logprobs: bool, tokens, lengths, tables, sampling) -> StepOutput:
        key = (decode, logprobs, tokens.shape, tables.shape)
        compiled = self._compiled.get(key)
        batch = (tokens, lengths, tables, sampling)
        if self.mesh is not None:
            batch = self._place_batch(batch)
        args = (self.state, self.kv_pool, *batch)
        if compiled is None:
            compiled = self._compile(args, decode, logprobs)
            self._compiled[key] = compiled
        self.kv_pool, out = compiled(*args)
        out = jax.device_get(out)  # the one device-to-host transfer of the step
        return StepOutput(tokens=out[0], logprobs=out[1:] if logprobs else None)

    def _compile(self, args, decode: bool, logprobs: bool):
        if self.mesh is None:
            return self._jitted.lower(*args, decode=decode, logprobs=logprobs).compile()
        # Explicit layouts: params and pool keep theirs (the donated pool comes back in place),
        # step inputs are split by rows over replicas, and the sampled tokens come back replicated.
        kv = [(self.kv_sharding, self.kv_sharding)] * len(self.kv_pool)
        batch = jax.tree.map(lambda x: x.sharding, args[2:])
        step = jax.jit(functools.partial(self._step, decode=decode, logprobs=logprobs),
                       in_shardings=(self.param_shardings, kv, *batch),
                       out_shardings=(kv, sharding.replicated(self.mesh)), donate_argnums=(1,))
        return step.lower(*args).compile()

    def _place_batch(self, batch):
        """Host step inputs onto the mesh, rows split over data-parallel replicas; re-places a pool
        that was allocated without the mesh (e.g. after a failed step)."""
        if self.kv_pool[0][0].sharding != self.kv_sharding:
            self.kv_pool = [(sharding.place(k, self.kv_sharding), sharding.place(v, self.kv_sharding))
                            for k, v in self.kv_pool]
        return jax.tree.map(lambda x: sharding.place(x, sharding.batch_sharding(self.mesh, np.shape(x))), batch)

    def _step(self, state, kv_pool, tokens, lengths, tables, sampling, *, decode: bool, logprobs: bool):
        """tokens: [B, T]; lengths: [B] tokens per sequence after this step; tables: [B, P]."""
        model = nnx.merge(self.graphdef, state)
        if decode:
            positions = (lengths - 1)[:, None]
            logits_index = None
        else:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
            logits_index = jnp.maximum(lengths - 1, 0)
        logits, kv_pool = model(tokens, positions, kv_pool, tables, lengths, decode=decode,
                                backend=self.config.attention_backend, logits_index=logits_index)
        logits = logits[:, 0]
        next_tokens = sample(logits, sampling, positions=lengths)
        if logprobs:
            return kv_pool, (next_tokens, *token_logprobs(logits, next_tokens, self.config.num_logprobs))
        return kv_pool, (next_tokens,)

    def warmup(self) -> int:
        """Compiles every prefill and decode bucket ahead of time (the null page absorbs the dummy
        writes); returns how many shapes were new."""
        before = self.num_compiles
        greedy = lambda n: SamplingBatch(np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32),
                                         np.zeros(n, np.float32), np.zeros(n, np.uint32))
        for length in self.length_buckets:
            for batch in powers_of_two(1, self.prefill_batch_size(length)):
                self.prefill([[0] * length] * batch, np.zeros((batch, self.pages_per_seq), np.int32), greedy(batch))
        slots = self.config.max_slots
        for n in self.slot_buckets:
            for width in self.width_buckets:
                lengths = np.zeros(slots, np.int32)
                lengths[:n] = width * self.config.page_size
                self.decode(np.zeros(slots, np.int32), lengths, np.zeros((slots, self.pages_per_seq), np.int32),
                            greedy(slots))
        return self.num_compiles - before


def _pad_sampling(sampling: SamplingBatch, size: int) -> SamplingBatch:
    """Pads rows with greedy, unfiltered parameters so padding never triggers the sorting path."""
    def pad(a, value):
        a = np.asarray(a)
        return np.concatenate([a, np.full(size - len(a), value, a.dtype)])
    return SamplingBatch(pad(sampling.temperature, 0), pad(sampling.top_k, 0), pad(sampling.top_p, 1),
                         pad(sampling.min_p, 0), pad(sampling.seed, 0))


def _take(out: StepOutput, n: int) -> StepOutput:
    logprobs = None if out.logprobs is None else tuple(a[:n] for a in out.logprobs)
    return StepOutput(tokens=out.tokens[:n], logprobs=logprobs)
