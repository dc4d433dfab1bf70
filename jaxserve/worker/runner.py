"""The compiled model step over the paged KV pool: one verb, `step` (or `dispatch` then
`collect`), for a ragged batch of decode tokens and prompt chunks. The runner computes and never
decides what runs.

Each step also keeps every sampling slot's token on the device (`slot_tokens`), and a token the
host does not have yet is read from there: so step N+1 can be dispatched before step N's tokens
reach the host, and the host's scheduling overlaps the device's work. The slot table's block
tables live on the device too (`block_tables`, [slots, G, W]): a step brings only the entries
written since the last one (a few per page crossed), and the forward program reads each
sequence's rows there, so what the host builds and copies per step never grows with
max_model_len.

A step is three compiled programs: the model's layers (`forward`) per token bucket of
`StepBuckets`, then the output layer and the sampler (`sample`, in each sampling mode: the host
picks the one the batch needs, so no branch waits on the device), and `logprobs` when a request
asks, per row bucket. What runs per token and what runs per sampled row are compiled apart, so
the programs add up (token buckets + row buckets) rather than multiply, and a prompt chunk alone
pays for the output layer on its one row. Every program is compiled ahead of time and counted,
`warmup()` compiles them all (several at once on machines with many cores), and each is saved to
an `ExecutableCache`, so a warm start loads them without tracing. The KV pool is donated to each
step and updated in place; the only device-to-host transfer per step is the sampled tokens (plus
log-probabilities when a request asks for them). Under a device mesh, parameters and pool keep
their shardings, step inputs are split by data-parallel replica, and attention runs per shard.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.distributed import sharding
from jaxserve.worker.compile_cache import ExecutableCache
from jaxserve.worker.programs import Programs
from jaxserve.worker.kv_pool import allocate_kv_pool, storage_dtype
from jaxserve.model.kv_groups import kv_groups
from jaxserve.model.paged_attention import StepMetadata
from jaxserve.model.transformer import Transformer
from jaxserve.pallas_kernels.backend import attention_fn
from jaxserve.worker.sampling import MODES, SamplingBatch, sample, token_logprobs
from jaxserve.worker.step_batch import (StepBatch, StepBuckets, StepLayout, pad_updates, padding_batch,
                                       table_metadata, write_table_entries)


TABLE_UPDATES = 256  # block-table entries a forward program writes: a step with more writes the rest first
SAMPLING_UPDATES = 64  # slots' sampling parameters one program writes


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    num_pages: int
    page_size: int
    max_slots: int
    max_model_len: int
    max_num_batched_tokens: int  # the largest step
    attention_backend: str = "reference"  # "reference" or "pallas" (resolved from "auto" by the engine)
    num_logprobs: int = 5
    decode_steps: int = 1  # > 1: the decode steps one program runs when every sequence decodes
    kv_dtype: str = "float32"
    # ((kind, size), dtype): each program's weights (a program not named: the model's); and the
    # smallest bucket (None: 2 for a bfloat16 model on CPU, else 1). See `jaxserve.worker.dtype_plan`.
    program_dtypes: tuple[tuple[tuple[str, int], str], ...] = ()
    min_rows: int | None = None
    cache_dir: str | None = None  # compiled programs are saved and loaded here (None: not kept)


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
    def __init__(self, model: Transformer, config: RunnerConfig, mesh=None, other: Transformer | None = None):
        """`mesh` (from `jaxserve.distributed.sharding.make_mesh`): lay params, KV pool and step inputs out on it.
        `other`: the same model in another dtype, for the programs `config.program_dtypes` puts in it."""
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
        self.dtype = str(model.embed[...].dtype)
        self.states = {self.dtype: self.state}
        if other is not None:
            if mesh is not None:
                raise ValueError("a second copy of the weights in another dtype is for one device only")
            self.states[str(other.embed[...].dtype)] = nnx.split(other)[1]
        self._program_dtype = dict(config.program_dtypes)
        missing = set(self._program_dtype.values()) - self.states.keys()
        if missing:
            raise ValueError(f"program_dtypes names {sorted(missing)}, but the weights are in {sorted(self.states)}")
        # On CPU the reference attention reads a bfloat16 pool kept as bits (see kv_pool).
        as_bits = config.attention_backend == "reference" and jax.default_backend() == "cpu"
        self.kv_dtype = storage_dtype(config.kv_dtype, as_bits)
        self.kv_pool = allocate_kv_pool(model.cfg, config.num_pages, config.page_size, self.kv_dtype, kv_sharding)
        self.slot_tokens = self._zeros_slot_tokens()  # [max_slots] each slot's last sampled token
        self.slot_sampling = self._greedy_slot_sampling()  # [max_slots + 1] each slot's; the last: padding's
        self.pages_per_seq = -(-config.max_model_len // config.page_size)
        self.kv_groups = kv_groups(model.cfg)  # a block table per group and sequence
        self.block_tables = self._zeros_tables()  # [max_slots, G, W] every slot's block tables
        # Each replica's slice is bucketed; a replica holds at most its share of the slots. XLA:CPU
        # runs a bfloat16 dot with one row 5-10x slower than with two, so no step has one row there.
        one_row_trap = jax.default_backend() == "cpu" and self.dtype == "bfloat16"
        min_rows = config.min_rows or (2 if one_row_trap else 1)
        self.buckets = StepBuckets(max_tokens=config.max_num_batched_tokens,
                                   max_seqs=config.max_slots // self.replicas, min_rows=min_rows)
        self._no_mask: dict[int, jax.Array] = {}  # all-ones token masks per row bucket (see `_all_allowed`)
        self._batch_shardings: dict[tuple, object] = {}  # per input shape, under a mesh (see `_place`)
        devices = jax.devices()[:1] if mesh is None else mesh.devices.flat
        # Each process of a multi-host group keeps its own entries: a program is loaded onto its local devices.
        self.cache = None if config.cache_dir is None else ExecutableCache(
            config.cache_dir, f"{self.describe_programs()}\nprocess {jax.process_index()}", devices)
        self.programs = Programs(self.program, self.cache)
        self.tokens_run = 0  # real tokens through the model ...
        self.tokens_computed = 0  # ... and with bucket padding
        self.mirror = None  # a multi-host leader's multihost.Mirror: the other processes run each step too

    @property
    def num_compiles(self) -> int:
        """Programs compiled or loaded: a steady workload adds none."""
        return len(self.programs)

    def step(self, batch: StepBatch, logprobs: bool = False) -> StepOutput:
        """Runs one ragged batch: writes every token's K/V, samples one token per sequence row."""
        return self.collect(self.dispatch(batch, logprobs))

    def dispatch(self, batch: StepBatch, logprobs: bool = False) -> InFlight:
        """Starts a step on the device and returns at once."""
        if self.mirror is None:
            return self._dispatch(batch, logprobs)
        self.mirror.step(batch, logprobs)  # before this process runs it: the programs' collectives span the group
        return self.mirror.run(self._dispatch, batch, logprobs)

    def _dispatch(self, batch: StepBatch, logprobs: bool) -> InFlight:
        tokens, rows = (n // self.replicas for n in batch.shape)  # a replica's buckets
        self._write_sampling(batch.sampling_slots, batch.sampling)
        packed, allowed = self.step_inputs(batch, self._table_updates(batch.table_updates))
        if batch.decode_steps > 1:
            key = ("decode", rows, batch.sampling_mode)
            self.kv_pool, self.block_tables, self.slot_tokens, drawn = self.programs.get(key)(
                self.state_for(("forward", tokens)), self.kv_pool, self.slot_tokens, self.slot_sampling,
                self.block_tables, packed)
            self.tokens_run += batch.num_tokens
            self.tokens_computed += batch.shape[0] * self.config.decode_steps
            drawn.copy_to_host_async()
            return InFlight((drawn,), False)
        key = ("forward", tokens)
        self.kv_pool, self.block_tables, hidden, positions, slots = self.programs.get(key)(
            self.state_for(key), self.kv_pool, self.slot_tokens, self.block_tables, packed)
        key = ("sample", rows, batch.sampling_mode)
        self.slot_tokens, next_tokens, logits = self.programs.get(key)(
            self.state_for(key), self.slot_tokens, self.slot_sampling, hidden, positions, slots, allowed)
        out = (next_tokens,)
        if logprobs:
            out += tuple(self.programs.get(("logprobs", rows))(logits, next_tokens))
        self.tokens_run += batch.num_tokens
        self.tokens_computed += batch.shape[0]
        for x in out:
            x.copy_to_host_async()
        return InFlight(out, logprobs)

    def _table_updates(self, updates: np.ndarray) -> np.ndarray:
        """The last [TABLE_UPDATES, 4] block-table entries, which go with the step's inputs; any
        before them are written first, by a program of their own (admissions of long prompts)."""
        last = max(0, (len(updates) - 1) // TABLE_UPDATES * TABLE_UPDATES)
        for start in range(0, last, TABLE_UPDATES):
            chunk = pad_updates(updates, start, TABLE_UPDATES, self.config.max_slots)
            self.block_tables = self.programs.get(("tables", TABLE_UPDATES))(
                self.block_tables, chunk if self.mesh is None else self._replicated(chunk))
        return pad_updates(updates, last, TABLE_UPDATES, self.config.max_slots)

    def _write_sampling(self, slots: np.ndarray, params: SamplingBatch) -> None:
        """Writes the sampling parameters of the slots that changed (admitted or freed)."""
        write = self.programs.get(("sampling", SAMPLING_UPDATES)) if len(slots) else None
        for start in range(0, len(slots), SAMPLING_UPDATES):
            chunk = np.full(SAMPLING_UPDATES, self.config.max_slots + 1, np.int32)  # past the table: dropped
            part = slots[start: start + SAMPLING_UPDATES]
            chunk[: len(part)] = part
            rows = SamplingBatch.greedy(SAMPLING_UPDATES)
            for field in dataclasses.fields(rows):
                values = getattr(params, field.name)
                if values is not None:
                    getattr(rows, field.name)[: len(part)] = values[start: start + SAMPLING_UPDATES]
            self.slot_sampling = write(self.slot_sampling, self._host_or_replicated(chunk),
                                       jax.tree.map(self._host_or_replicated, rows))

    def _host_or_replicated(self, x: np.ndarray):
        return x if self.mesh is None else self._replicated(x)

    def collect(self, step: InFlight) -> StepOutput:
        """Waits for a dispatched step's sampled tokens (the one device-to-host transfer of a step)."""
        out = _to_host(step.outputs) if self.mirror is None else self.mirror.run(_to_host, step.outputs)
        return StepOutput(tokens=out[0], logprobs=out[1:] if step.logprobs else None)

    def layout(self, tokens: int, decode_steps: bool = False) -> StepLayout:
        """Where the inputs of a step of `tokens` tokens (a replica's bucket) sit in its one array."""
        return StepLayout(tokens, self.buckets.seqs(tokens), self.buckets.max_rows, TABLE_UPDATES, decode_steps)

    def step_inputs(self, batch: StepBatch, table_updates: np.ndarray) -> tuple:
        """(packed, allowed): the batch's inputs and the table updates [TABLE_UPDATES, 4] in one
        int32 array [replicas, width] (`StepLayout`: the step's one host-to-device copy, passed to
        the program as a host array, which costs the host less than a device_put while a step
        runs), and the token masks of its sampling rows (a mask kept on the device when no row
        is constrained)."""
        layout = self.layout(batch.shape[0] // self.replicas, batch.decode_steps > 1)
        packed = layout.pack(batch, table_updates, self.replicas, self.config.max_slots)
        if self.mesh is not None:
            packed = self._place(packed)
        allowed = self._all_allowed(len(batch.sample_slots)) if batch.allowed is None else \
            self._place_rows(batch.allowed)
        return packed, allowed

    def state_for(self, key: tuple):
        """The weights the program `key` runs on: the model's, or their copy in the dtype
        `config.program_dtypes` gives it."""
        return self.states[self._program_dtype.get(key[:2], self.dtype)]

    def _all_allowed(self, rows: int) -> jax.Array:
        """The mask [rows, M] that allows every token, kept on the device per row bucket: a step
        without structured output sends no mask."""
        mask = self._no_mask.get(rows)
        if mask is None:  # M = ceil(V / 32) int32 words a row
            words = -(-self.model_config.vocab_size // 32)
            mask = self._no_mask[rows] = self._place_rows(np.full((rows, words), -1, np.int32))
        return mask

    def _place_rows(self, x: np.ndarray):
        return jax.device_put(x) if self.mesh is None else self._place(x)

    # ---- the three programs of a step ----

    def _inputs(self, layout: StepLayout, packed, block_tables):
        """The step's inputs from its one array, with its table updates written into the block
        tables: (block tables, inputs by name, metadata with each sequence's tables and pool slots)."""
        x = layout.unpack(packed)
        block_tables = write_table_entries(block_tables, x["table_updates"])
        meta = StepMetadata(positions=x["positions"], slot_mapping=None, kv_lens=x["kv_lens"], block_tables=None,
                            query_start=x["query_start"], num_seqs=x["num_seqs"])
        return block_tables, x, meta

    def _forward(self, layout: StepLayout, state, kv_pool, slot_tokens, block_tables, packed):
        """The table updates into the block tables, then K/V of every token into the pool; returns
        the pool, the tables, the final hidden states [W, D] of each sequence's last token (rows
        logits_indices [W], a replica's slice after another's), and the sampling rows' positions
        and slots [W] (each replica's), which the sample program takes with the hidden states."""
        model = nnx.merge(self.graphdef, state)
        block_tables, x, meta = self._inputs(layout, packed, block_tables)
        meta = table_metadata(meta, block_tables, x["seq_slots"], x["token_seq_slots"], self.config.page_size)
        token_slots = x["token_slots"]
        tokens = jnp.where(token_slots >= 0, slot_tokens[jnp.maximum(token_slots, 0)], x["tokens"])
        hidden, kv_pool = model.hidden_states(tokens, kv_pool, meta, attend=self.attend, rows=x["logits_indices"])
        return kv_pool, block_tables, hidden, x["sample_positions"], x["sample_slots"]

    def _first_rows(self, x, rows: int):
        """Each replica's first `rows` of x [replicas * W, ...]."""
        return x.reshape(self.replicas, -1, *x.shape[1:])[:, :rows].reshape(-1, *x.shape[1:])

    def _sample(self, mode: str, state, slot_tokens, slot_sampling: SamplingBatch, hidden, positions, sample_slots,
                allowed):
        """The logits [R, V] of each replica's first R rows of hidden (R from allowed [R, M]), and
        one token per row [R], drawn with its slot's sampling parameters among the tokens allowed
        permits (padding rows read the greedy row past the slots); each sampling row's token also
        kept in its slot for the next step. The logits returned (for logprobs) are the model's,
        unmasked."""
        rows = allowed.shape[0] // self.replicas
        hidden, positions, sample_slots = (self._first_rows(x, rows) for x in (hidden, positions, sample_slots))
        logits = nnx.merge(self.graphdef, state).logits(hidden)
        params = slot_sampling.at(jnp.minimum(sample_slots, self.config.max_slots))
        next_tokens = sample(logits, params, positions=positions, allowed=allowed, mode=mode)
        return slot_tokens.at[sample_slots].set(next_tokens, mode="drop"), next_tokens, logits

    def _decode(self, layout: StepLayout, rows: int, mode: str, state, kv_pool, slot_tokens,
                slot_sampling: SamplingBatch, block_tables, packed):
        """`config.decode_steps` decode steps of a batch where every sequence runs one token, in one
        program: each step reads the tokens the step before sampled (slot tokens), writes their
        K/V and samples the next at the next position. A row stops after its row_steps steps or on
        a token of its stop ids (EOS, stop token ids); from then on it writes only the null page
        and keeps its slot token. Returns the pool, the tables, the slot tokens and the tokens
        [K, R] each step sampled (a stopped row's: ignored by the host)."""
        model = nnx.merge(self.graphdef, state)
        block_tables, x, meta = self._inputs(layout, packed, block_tables)
        num_slots = self.config.max_slots
        token_steps, seq_steps, token_seq_slots = x["token_steps"], x["seq_steps"], x["token_seq_slots"]
        sample_positions, sample_slots, row_steps = (self._first_rows(x[name], rows)
                                                     for name in ("sample_positions", "sample_slots", "row_steps"))
        params = slot_sampling.at(jnp.minimum(sample_slots, num_slots))

        def one_step(j, carry):
            kv_pool, slot_tokens, done, out = carry
            done_slots = jnp.zeros(num_slots + 1, bool).at[jnp.minimum(sample_slots, num_slots)].set(done)
            token_live = (j < token_steps) & ~done_slots[jnp.maximum(token_seq_slots, 0)]
            at = lambda v, steps: v + jnp.minimum(j, jnp.maximum(steps - 1, 0))  # noqa: E731 (a stopped row stays)
            step_meta = dataclasses.replace(meta, positions=at(meta.positions, token_steps),
                                            kv_lens=jnp.where(meta.kv_lens > 0, at(meta.kv_lens, seq_steps), 0))
            step_meta = table_metadata(step_meta, block_tables, x["seq_slots"],
                                       jnp.where(token_live, token_seq_slots, -1), self.config.page_size)
            source = jnp.where(j == 0, x["token_slots"], token_seq_slots)
            step_tokens = jnp.where(source >= 0, slot_tokens[jnp.maximum(source, 0)], x["tokens"])
            hidden, kv_pool = model.hidden_states(step_tokens, kv_pool, step_meta, attend=self.attend,
                                                  rows=x["logits_indices"])
            drawn = sample(model.logits(self._first_rows(hidden, rows)), params, positions=sample_positions + j,
                           mode=mode)
            live = (j < row_steps) & ~done
            slot_tokens = slot_tokens.at[jnp.where(live, sample_slots, num_slots)].set(drawn, mode="drop")
            stopped = jnp.any(drawn[:, None] == params.stop_ids, axis=1) | (j + 1 >= row_steps)
            return kv_pool, slot_tokens, done | (live & stopped), out.at[j].set(drawn)

        out = jnp.zeros((self.config.decode_steps, sample_slots.shape[0]), jnp.int32)
        kv_pool, slot_tokens, _, out = repeat(self.config.decode_steps, one_step,
                                              (kv_pool, slot_tokens, row_steps == 0, out))
        return kv_pool, block_tables, slot_tokens, out

    def _logprobs(self, logits, tokens):
        return token_logprobs(logits, tokens, self.config.num_logprobs)

    def _zeros_tables(self):
        return self._replicated(np.zeros((self.config.max_slots, self.kv_groups.num_groups, self.pages_per_seq),
                                         np.int32))

    def _zeros_slot_tokens(self):
        return self._replicated(np.zeros(self.config.max_slots, np.int32))

    def _greedy_slot_sampling(self) -> SamplingBatch:
        return jax.tree.map(self._replicated, SamplingBatch.greedy(self.config.max_slots + 1))

    def _replicated(self, x: np.ndarray):
        """A host array on the device, or on every device of the mesh."""
        return jax.device_put(x) if self.mesh is None else sharding.place(x, sharding.replicated(self.mesh))

    def warmup(self, progress=None, workers: int | None = None) -> int:
        """Compiles (or loads) every program a step may run; see `Programs.warmup`."""
        return self.programs.warmup(self.all_programs(), progress, workers)

    def recover(self) -> bool:
        """After a failed step, which may have consumed the donated pool: fresh state if so.
        Returns whether the pool is a new, zeroed one (every K/V it held is gone)."""
        if self.slot_tokens.is_deleted():
            self.slot_tokens = self._zeros_slot_tokens()
        if any(x.is_deleted() for x in jax.tree.leaves(self.slot_sampling)):
            self.slot_sampling = self._greedy_slot_sampling()  # the engine writes every running slot's again
        if not self.block_tables.is_deleted() and not any(x.is_deleted() for x in self.kv_pool):
            return False
        self.block_tables = self._zeros_tables()  # their entries are rewritten as the requests run again
        self.kv_pool = allocate_kv_pool(self.model_config, self.config.num_pages, self.config.page_size,
                                        self.kv_dtype, self.kv_sharding)
        return True

    # ---- compilation ----

    def all_programs(self) -> list[tuple]:
        """The key of every program a step may run: the table and sampling-parameter updates,
        forward per token bucket, sample per row bucket and sampling mode, logprobs per row bucket."""
        rows = self.buckets.row_sizes
        return ([("tables", TABLE_UPDATES), ("sampling", SAMPLING_UPDATES)]
                + [("forward", t) for t in self.buckets.token_sizes]
                + [("sample", r, m) for r in rows for m in MODES] + [("logprobs", r) for r in rows]
                + ([("decode", r, m) for r in rows for m in MODES] if self.config.decode_steps > 1 else []))

    def program(self, key: tuple):
        """(jitted function, arguments to lower it with) of the program `key` (see `all_programs`)."""
        kind, size = key[:2]
        tokens, rows = (size, self.buckets.min_rows) if kind == "forward" else (self.buckets.token_sizes[0], size)
        if kind == "decode":  # a decode step's tokens: one per row
            tokens = self.buckets.shape(size, size)[0]
        batch = padding_batch(tokens, rows, self.buckets, self.config.max_slots, self.replicas)
        batch.decode_steps = self.config.decode_steps if kind == "decode" else 1
        layout = self.layout(tokens, kind == "decode")
        packed, allowed = self.step_inputs(batch, pad_updates(batch.table_updates, 0, TABLE_UPDATES,
                                                              self.config.max_slots))
        state = self.state_for(("forward", tokens) if kind == "decode" else key)
        rows, width = self.replicas * size, self.replicas * self.buckets.max_rows
        logits = jax.ShapeDtypeStruct((rows, self.model_config.vocab_size), jnp.float32,
                                      sharding=self._rows_sharding((rows, self.model_config.vocab_size)))
        hidden = jax.ShapeDtypeStruct((width, self.model_config.hidden_size), jnp.float32,
                                      sharding=self._rows_sharding((width, self.model_config.hidden_size)))
        row_inputs = jax.ShapeDtypeStruct((width,), jnp.int32, sharding=self._rows_sharding((width,)))
        if kind == "tables":
            fn, donate = write_table_entries, (0,)
            args = (self.block_tables, self._replicated(pad_updates(np.zeros((0, 4), np.int32), 0, TABLE_UPDATES,
                                                                    self.config.max_slots)))
        elif kind == "sampling":
            fn, donate = _write_slot_sampling, (0,)
            args = (self.slot_sampling, self._replicated(np.zeros(size, np.int32)),
                    jax.tree.map(self._replicated, SamplingBatch.greedy(size)))
        elif kind == "forward":
            fn, donate = functools.partial(self._forward, layout), (1, 3)
            args = (state, self.kv_pool, self.slot_tokens, self.block_tables, packed)
        elif kind == "sample":
            fn, donate = functools.partial(self._sample, key[2]), (1,)
            args = (state, self.slot_tokens, self.slot_sampling, hidden, row_inputs, row_inputs, allowed)
        elif kind == "decode":
            fn, donate = functools.partial(self._decode, layout, size, key[2]), (1, 2, 4)
            args = (state, self.kv_pool, self.slot_tokens, self.slot_sampling, self.block_tables, packed)
        else:
            fn, donate = self._logprobs, ()
            args = (logits, jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=self._rows_sharding((rows,))))
        if self.mesh is None:
            return jax.jit(fn, donate_argnums=donate), args
        # Explicit layouts: params and pool keep theirs (the donated pool comes back in place),
        # step inputs and logits are split by replica, and slot and sampled tokens are replicated.
        replicated = sharding.replicated(self.mesh)
        kv = (self.kv_sharding, self.kv_sharding)
        shardings = jax.tree.map(lambda x: x.sharding, args)
        if kind in ("tables", "sampling"):
            out = replicated
        elif kind == "forward":
            shardings = (self.param_shardings, kv, *shardings[2:])
            out = (kv, replicated, hidden.sharding, row_inputs.sharding, row_inputs.sharding)
        elif kind == "sample":
            shardings = (self.param_shardings, *shardings[1:])
            out = (replicated, replicated, logits.sharding)
        elif kind == "decode":
            shardings = (self.param_shardings, kv, *shardings[2:])
            out = (kv, replicated, replicated, replicated)
        else:
            out = replicated
        return jax.jit(fn, in_shardings=shardings, out_shardings=out, donate_argnums=donate), args

    def _rows_sharding(self, shape):
        return None if self.mesh is None else sharding.batch_sharding(self.mesh, shape)

    def describe_programs(self) -> str:
        """Everything but the step's shape that changes a compiled program (the cache's key; the
        same in every process of a multi-host group)."""
        leaves = [(x.shape, str(x.dtype), str(getattr(x, "sharding", None)))
                  for x in jax.tree.leaves((self.states, self.kv_pool))]
        device = jax.devices()[0]
        return "\n".join(map(str, (
            self.model_config, self.config, self.buckets, leaves, jax.__version__, device.platform,
            device.client.platform_version, device.device_kind, jax.device_count(),
            self.mesh and dict(self.mesh.shape), os.environ.get("XLA_FLAGS", ""),
            jax.config.jax_default_matmul_precision)))

    def _place(self, inputs):
        """Host step inputs onto the mesh, split by replica (one sharding per shape, built once:
        a new one per call would miss jax's C++ dispatch path)."""
        return jax.tree.map(lambda x: sharding.place(x, self._batch_sharding(np.shape(x))), inputs)

    def _batch_sharding(self, shape: tuple[int, ...]):
        found = self._batch_shardings.get(shape)
        if found is None:
            found = self._batch_shardings[shape] = sharding.batch_sharding(self.mesh, shape)
        return found


def _to_host(arrays: tuple) -> list[np.ndarray]:
    return [np.asarray(x) for x in arrays]


def unrolls_loops() -> bool:
    """Whether `repeat` unrolls: on XLA:CPU, whose while loop ran Gemma 3 270M's decode step at
    half speed (4 steps: 289 ms in a loop, 154 ms unrolled)."""
    return jax.default_backend() == "cpu"


def repeat(steps: int, body, carry):
    """carry = body(j, carry) for j in 0.. steps - 1: unrolled where `unrolls_loops`, else a loop
    of known trip count (one body to compile; XLA needs no predicate from the device for it)."""
    if not unrolls_loops():
        return jax.lax.fori_loop(0, steps, body, carry)
    for j in range(steps):
        carry = body(j, carry)
    return carry


def _write_slot_sampling(slot_sampling: SamplingBatch, slots, rows: SamplingBatch) -> SamplingBatch:
    """slot_sampling [slots + 1] with rows [n] written at `slots` [n]; slots past the table drop."""
    return jax.tree.map(lambda table, values: table.at[slots].set(values, mode="drop"), slot_sampling, rows)
