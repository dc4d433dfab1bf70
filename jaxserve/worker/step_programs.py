"""The bodies of a step's compiled programs, traced by the runner (`Runner.program`), which
compiles, caches and dispatches them.

    forward  table entries into the block tables; K/V of every token into the pool; the hidden
             states of each sequence's last token (a token bucket's program)
    sample   the output layer and the sampler on each sampling row (a row bucket and mode's)
    decode   several decode steps in one program: forward and sample per step (a row bucket and
             mode's, with `decode_steps`)
    logprobs the sampled tokens' log-probabilities and the top alternatives (a row bucket's)

Every input of a step comes in one int32 array (`StepLayout`), and the slot state the programs
read and write (slot tokens, sampling parameters, block tables) stays on the device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.paged_attention import StepMetadata
from jaxserve.worker.sampling import SamplingBatch, sample, token_logprobs
from jaxserve.worker.step_batch import table_metadata, write_table_entries
from jaxserve.worker.step_layout import StepLayout


@dataclasses.dataclass(frozen=True, eq=False)
class StepPrograms:
    """What the programs close over: the model's graph, the attention, and the step's fixed sizes.
    The programs take the weights as a flat tuple of arrays (`weights`), whose structure they
    close over: jax flattens a tuple of arrays in C++, an nnx.State in Python, variable by variable,
    on every call."""

    graphdef: object
    state_def: object  # the tree structure of the model's nnx.State
    attend: object  # the attention function (per shard under a mesh)
    replicas: int  # data-parallel replicas: each holds an equal slice of every step array
    page_size: int
    max_slots: int
    decode_steps: int
    num_logprobs: int

    def model(self, weights):
        """The model, from the flat tuple of its weights."""
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.state_def, weights))

    def inputs(self, layout: StepLayout, packed, block_tables):
        """The step's inputs from its one array, with its table updates written into the block
        tables: (block tables, inputs by name, metadata with each sequence's tables and pool slots)."""
        x = layout.unpack(packed)
        block_tables = write_table_entries(block_tables, x["table_updates"])
        meta = StepMetadata(positions=x["positions"], slot_mapping=None, kv_lens=x["kv_lens"], block_tables=None,
                            query_start=x["query_start"], num_seqs=x["num_seqs"])
        return block_tables, x, meta

    def forward(self, layout: StepLayout, state, kv_pool, slot_tokens, block_tables, packed):
        """The table updates into the block tables, then K/V of every token into the pool; returns
        the pool, the tables, the final hidden states [W, D] of each sequence's last token (rows
        logits_indices [W], a replica's slice after another's), and the sampling rows' positions
        and slots [W] (each replica's), which the sample program takes with the hidden states."""
        model = self.model(state)
        block_tables, x, meta = self.inputs(layout, packed, block_tables)
        meta = table_metadata(meta, block_tables, x["seq_slots"], x["token_seq_slots"], self.page_size)
        token_slots = x["token_slots"]
        tokens = jnp.where(token_slots >= 0, slot_tokens[jnp.maximum(token_slots, 0)], x["tokens"])
        hidden, kv_pool = model.hidden_states(tokens, kv_pool, meta, attend=self.attend, rows=x["logits_indices"])
        return kv_pool, block_tables, hidden, x["sample_positions"], x["sample_slots"]

    def first_rows(self, x, rows: int):
        """Each replica's first `rows` of x [replicas * W, ...]."""
        return x.reshape(self.replicas, -1, *x.shape[1:])[:, :rows].reshape(-1, *x.shape[1:])

    def sample(self, mode: str, state, slot_tokens, slot_sampling: SamplingBatch, hidden, positions, sample_slots,
                allowed):
        """The logits [R, V] of each replica's first R rows of hidden (R from allowed [R, M]), and
        one token per row [R], drawn with its slot's sampling parameters among the tokens allowed
        permits (padding rows read the greedy row past the slots); each sampling row's token also
        kept in its slot for the next step. The logits returned (for logprobs) are the model's,
        unmasked."""
        rows = allowed.shape[0] // self.replicas
        hidden, positions, sample_slots = (self.first_rows(x, rows) for x in (hidden, positions, sample_slots))
        logits = self.model(state).logits(hidden)
        params = slot_sampling.at(jnp.minimum(sample_slots, self.max_slots))
        next_tokens = sample(logits, params, positions=positions, allowed=allowed, mode=mode)
        return slot_tokens.at[sample_slots].set(next_tokens, mode="drop"), next_tokens, logits

    def decode(self, layout: StepLayout, rows: int, mode: str, state, kv_pool, slot_tokens,
                slot_sampling: SamplingBatch, block_tables, packed):
        """`config.decode_steps` decode steps of a batch where every sequence runs one token, in one
        program: each step reads the tokens the step before sampled (slot tokens), writes their
        K/V and samples the next at the next position. A row stops after its row_steps steps or on
        a token of its stop ids (EOS, stop token ids); from then on it writes only the null page
        and keeps its slot token. Returns the pool, the tables, the slot tokens and the tokens
        [K, R] each step sampled (a stopped row's: ignored by the host)."""
        model = self.model(state)
        block_tables, x, meta = self.inputs(layout, packed, block_tables)
        num_slots = self.max_slots
        token_steps, seq_steps, token_seq_slots = x["token_steps"], x["seq_steps"], x["token_seq_slots"]
        sample_positions, sample_slots, row_steps = (self.first_rows(x[name], rows)
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
                                       jnp.where(token_live, token_seq_slots, -1), self.page_size)
            source = jnp.where(j == 0, x["token_slots"], token_seq_slots)
            step_tokens = jnp.where(source >= 0, slot_tokens[jnp.maximum(source, 0)], x["tokens"])
            hidden, kv_pool = model.hidden_states(step_tokens, kv_pool, step_meta, attend=self.attend,
                                                  rows=x["logits_indices"])
            drawn = sample(model.logits(self.first_rows(hidden, rows)), params, positions=sample_positions + j,
                           mode=mode)
            live = (j < row_steps) & ~done
            slot_tokens = slot_tokens.at[jnp.where(live, sample_slots, num_slots)].set(drawn, mode="drop")
            stopped = jnp.any(drawn[:, None] == params.stop_ids, axis=1) | (j + 1 >= row_steps)
            return kv_pool, slot_tokens, done | (live & stopped), out.at[j].set(drawn)

        out = jnp.zeros((self.decode_steps, sample_slots.shape[0]), jnp.int32)
        kv_pool, slot_tokens, _, out = repeat(self.decode_steps, one_step,
                                              (kv_pool, slot_tokens, row_steps == 0, out))
        return kv_pool, block_tables, slot_tokens, out

    def logprobs(self, logits, tokens):
        return token_logprobs(logits, tokens, self.num_logprobs)


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


def write_slot_sampling(slot_sampling: SamplingBatch, slots, rows: SamplingBatch) -> SamplingBatch:
    """slot_sampling [slots + 1] with rows [n] written at `slots` [n]; slots past the table drop."""
    return jax.tree.map(lambda table, values: table.at[slots].set(values, mode="drop"), slot_sampling, rows)
