"""What each of a runner's programs is compiled from: its body (`step_programs`), the arguments
to lower it with (live state and padding inputs of its bucket's shapes), what it donates, and
under a mesh its input and output shardings.

Keys (`Runner.all_programs`): ("tables", U) and ("sampling", n) write slot state; ("forward", T)
per token bucket; ("sample", R, mode) and ("logprobs", R) per row bucket; ("decode", R, mode)
with several decode steps per dispatch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.distributed import sharding
from jaxserve.worker.sampling import SamplingBatch
from jaxserve.worker.step_batch import pad_updates, padding_batch, write_table_entries
from jaxserve.worker.step_programs import write_slot_sampling

TABLE_UPDATES = 256  # block-table entries a forward program writes: a step with more writes the rest first


def program_spec(runner, key: tuple) -> tuple:
    """(jitted function, arguments to lower it with) of `runner`'s program `key`."""
    kind, size = key[:2]
    tokens, rows = (size, runner.buckets.min_rows) if kind == "forward" else (runner.buckets.token_sizes[0], size)
    if kind == "decode":  # a decode step's tokens: one per row
        tokens = runner.buckets.shape(size, size)[0]
    batch = padding_batch(tokens, rows, runner.buckets, runner.config.max_slots, runner.replicas)
    batch.decode_steps = runner.config.decode_steps if kind == "decode" else 1
    layout = runner.layout(tokens, kind == "decode")
    packed, allowed = runner.step_inputs(batch, pad_updates(batch.table_updates, 0, TABLE_UPDATES,
                                                          runner.config.max_slots))
    state = runner.state_for(("forward", tokens) if kind == "decode" else key)
    rows, width = runner.replicas * size, runner.replicas * runner.buckets.max_rows
    logits = jax.ShapeDtypeStruct((rows, runner.model_config.vocab_size), jnp.float32,
                                  sharding=runner.rows_sharding((rows, runner.model_config.vocab_size)))
    hidden = jax.ShapeDtypeStruct((width, runner.model_config.hidden_size), jnp.float32,
                                  sharding=runner.rows_sharding((width, runner.model_config.hidden_size)))
    row_inputs = jax.ShapeDtypeStruct((width,), jnp.int32, sharding=runner.rows_sharding((width,)))
    if kind == "tables":
        fn, donate = write_table_entries, (0,)
        args = (runner.block_tables, runner.replicated(pad_updates(np.zeros((0, 4), np.int32), 0, TABLE_UPDATES,
                                                                runner.config.max_slots)))
    elif kind == "sampling":
        fn, donate = write_slot_sampling, (0,)
        args = (runner.slot_sampling, runner.replicated(np.zeros(size, np.int32)),
                jax.tree.map(runner.replicated, SamplingBatch.greedy(size)))
    elif kind == "forward":
        fn, donate = functools.partial(runner.bodies.forward, layout), (1, 3)
        args = (state, runner.kv_pool, runner.slot_tokens, runner.block_tables, packed)
    elif kind == "sample":
        fn, donate = functools.partial(runner.bodies.sample, key[2]), (1,)
        args = (state, runner.slot_tokens, runner.slot_sampling, hidden, row_inputs, row_inputs, allowed)
    elif kind == "decode":
        fn, donate = functools.partial(runner.bodies.decode, layout, size, key[2]), (1, 2, 4)
        args = (state, runner.kv_pool, runner.slot_tokens, runner.slot_sampling, runner.block_tables, packed)
    else:
        fn, donate = runner.bodies.logprobs, ()
        args = (logits, jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=runner.rows_sharding((rows,))))
    if runner.mesh is None:
        return jax.jit(fn, donate_argnums=donate), args
    # Explicit layouts: params and pool keep theirs (the donated pool comes back in place),
    # step inputs and logits are split by replica, and slot and sampled tokens are replicated.
    replicated = sharding.replicated(runner.mesh)
    weights = tuple(jax.tree.leaves(runner.param_shardings))  # flat, like the weights (`StepPrograms`)
    kv = (runner.kv_sharding, runner.kv_sharding)
    shardings = jax.tree.map(lambda x: x.sharding, args)
    if kind in ("tables", "sampling"):
        out = replicated
    elif kind == "forward":
        shardings = (weights, kv, *shardings[2:])
        out = (kv, replicated, hidden.sharding, row_inputs.sharding, row_inputs.sharding)
    elif kind == "sample":
        shardings = (weights, *shardings[1:])
        out = (replicated, replicated, logits.sharding)
    elif kind == "decode":
        shardings = (weights, kv, *shardings[2:])
        out = (kv, replicated, replicated, replicated)
    else:
        out = replicated
    return jax.jit(fn, in_shardings=shardings, out_shardings=out, donate_argnums=donate), args
