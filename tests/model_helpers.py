"""Helpers shared by the model tests."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.worker.kv_pool import allocate_kv_pool
from jaxserve.model.kv_groups import kv_groups
from jaxserve.model.transformer import Transformer
from jaxserve.pallas_kernels.backend import attention_fn
from jaxserve.worker.step_batch import ScheduledSeq, StepBuckets, StepSeqs, build_step, table_metadata

PAGE = 8


def run_chunk(model, pool, table, start, tokens, bucket, backend="reference"):
    """One step of one sequence: `tokens` at positions start.. through the pool, padded to `bucket`
    tokens (one shape, so one compile, for every step of a sequence). Returns (logits [len(tokens), V], pool)."""
    batch = build_step(StepSeqs.of([ScheduledSeq(0, start, list(tokens))]), 1, PAGE,
                       StepBuckets(max_tokens=bucket, max_seqs=1, min_rows=bucket))
    meta = table_metadata(batch.meta, table, batch.seq_slots, batch.token_seq_slots, PAGE)
    graphdef, state = nnx.split(model)
    logits, pool = _forward(graphdef, backend, state, batch.tokens, pool, meta)
    return np.asarray(logits[: len(tokens)]), pool


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(graphdef, backend, state, tokens, pool, meta):
    return nnx.merge(graphdef, state)(tokens, pool, meta, attend=attention_fn(backend))


def paged_logits(model: Transformer, tokens: np.ndarray, prompt_len: int, chunk: int | None = None) -> np.ndarray:
    """Logits [len(tokens), V]: the prompt in chunks of `chunk` tokens (default: whole), then one
    decode step per further token, through a permuted block table (one per KV-cache group, pages
    apart)."""
    pages_needed, groups = -(-len(tokens) // PAGE), kv_groups(model.cfg).num_groups
    pool = allocate_kv_pool(model.cfg, 32, PAGE, jnp.float32)
    table = np.random.RandomState(1).permutation(np.arange(1, 32))[:groups * pages_needed]
    table = table.reshape(1, groups, pages_needed).astype(np.int32)
    steps = [(s, min(s + (chunk or prompt_len), prompt_len)) for s in range(0, prompt_len, chunk or prompt_len)]
    steps += [(t, t + 1) for t in range(prompt_len, len(tokens))]
    rows, bucket = [], max(stop - start for start, stop in steps)
    for start, stop in steps:
        logits, pool = run_chunk(model, pool, table, start, tokens[start:stop], bucket)
        rows.append(logits)
    return np.concatenate(rows)
