"""On-device token sampling, one row per sequence: greedy, temperature, top-k, top-p and min-p.

Each row's key is derived from the request's seed and the position of the token being sampled,
so a request draws the same tokens whatever else shares its batch.
Legend: B rows, V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch:
    """Per-row sampling parameters, all [B]."""

    temperature: jax.Array  # float32, 0 = greedy
    top_k: jax.Array  # int32, 0 = off
    top_p: jax.Array  # float32
    min_p: jax.Array  # float32
    seed: jax.Array  # uint32

    @classmethod
    def from_table(cls, table, rows=slice(None)) -> "SamplingBatch":
        """Host arrays of a scheduler `SlotTable` (optionally a subset of its rows)."""
        return cls(table.temperature[rows], table.top_k[rows], table.top_p[rows],
                   table.min_p[rows], table.seed[rows])


def sample(logits: jax.Array, params: SamplingBatch, positions: jax.Array) -> jax.Array:
    """logits: [B, V] float32; positions: [B] index of the token being sampled. Returns [B] int32."""
    greedy = argmax(logits)
    return jax.lax.cond(jnp.all(params.temperature == 0), lambda: greedy,
                        lambda: jnp.where(params.temperature == 0, greedy, _sample_random(logits, params, positions)))


def argmax(logits: jax.Array, chunk: int = 512) -> jax.Array:
    """Row-wise argmax [B] (first maximum wins), as two small reductions over [B, V/chunk, chunk]:
    on CPU this is ~15x faster than one variadic argmax reduction over a 262k vocabulary."""
    b, v = logits.shape
    if v <= chunk:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    pad = -v % chunk
    chunks = jnp.pad(logits, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(b, -1, chunk)
    best_chunk = jnp.argmax(chunks.max(axis=-1), axis=-1)
    within = jnp.argmax(jnp.take_along_axis(chunks, best_chunk[:, None, None], axis=1)[:, 0], axis=-1)
    return (best_chunk * chunk + within).astype(jnp.int32)


def _sample_random(logits, params: SamplingBatch, positions):
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(params.seed, positions)
    scaled = logits / jnp.maximum(params.temperature, 1e-6)[:, None]
    needs_filter = (params.top_k > 0) | (params.top_p < 1) | (params.min_p > 0)
    # Sorting the vocabulary is the costly part: do it only when some row filters.
    return jax.lax.cond(jnp.any(needs_filter),
                        lambda: jax.vmap(_sample_filtered)(keys, scaled, params.top_k, params.top_p, params.min_p),
                        lambda: jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32))


def _sample_filtered(key, scaled, top_k, top_p, min_p):
    """One row: top-k, then top-p on the renormalized rest, then min-p, then a categorical draw."""
    vocab = scaled.shape[-1]
    order = jnp.argsort(-scaled)
    ranked = scaled[order]
    rank = jnp.arange(vocab)
    ranked = jnp.where((top_k == 0) | (rank < top_k), ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked)
    keep = (jnp.cumsum(probs) - probs) < top_p
    keep &= probs >= min_p * probs[0]
    keep = keep.at[0].set(True)
    choice = jax.random.categorical(key, jnp.where(keep, ranked, -jnp.inf))
    return order[choice].astype(jnp.int32)


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The sampled tokens' log-probabilities [B] and the top k alternatives
    (ids [B, k], log-probabilities [B, k]) under the model's distribution."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    top_logp, top_ids = jax.lax.top_k(logp, k)
    return chosen, top_ids.astype(jnp.int32), top_logp
