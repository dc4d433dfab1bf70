"""Attention against the paged KV pool for one ragged step: the step's metadata, the K/V write,
and the attention call.

A step is a flat run of tokens from many sequences (decode tokens and prompt chunks alike). Each
token's K/V goes to its pool slot (`slot_mapping`), then every query attends over its own
sequence's pages through `attend`, a function chosen by the runner: a backend of
`jaxserve.pallas_kernels.backend`, wrapped per shard under a device mesh.
Each KV-cache group (`jaxserve.model.kv_groups`) has its own pages, so the step carries a block
table and a pool slot per group; a layer takes its group's (`for_group`), and what `attend` sees
is one block table per sequence, as before. A sliding-window group's pages before the window are
the null page: attention masks every key before the window, so their contents are never used.
Pool layout: k, v `[N, P, M, S, K]`, P layers per page; a layer writes and reads its own slot
(index `layer`) in place, never a copy of it. Page 0 is the null page that padding reads and writes.
Legend: T tokens, R sequences, G groups, W pages per sequence, P layers per page, N kv heads,
M pool pages, S page size, K head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepMetadata:
    """Where a step's tokens sit and what each one sees (host-built int32 arrays).

    Under a device mesh every array holds the data-parallel replicas one after another: replica r's
    tokens, sequences and query offsets (local to its tokens) form the r-th equal slice.
    """

    positions: jax.Array  # [T] position of each token in its sequence
    slot_mapping: jax.Array  # [T, G] pool slot page * S + offset of each token's K/V per group; padding: 0
    kv_lens: jax.Array  # [R] tokens of each sequence after this step; padding sequences: 0
    block_tables: jax.Array  # [R, G, W] page ids per group; past a sequence's pages, before a window: 0
    query_start: jax.Array  # [R + 1] first token of each sequence, then the end
    num_seqs: jax.Array  # [1] real sequences (the rest are padding)


def for_group(meta: StepMetadata, group) -> StepMetadata:
    """The metadata one layer sees: its group's (`group`, an int32 scalar) pool slots [T] and block
    tables [R, W]. The sequence axis stays first, so a data-parallel split of it is kept."""
    pick = lambda x: jax.lax.dynamic_index_in_dim(x, group, axis=1, keepdims=False)  # noqa: E731
    return dataclasses.replace(meta, slot_mapping=pick(meta.slot_mapping), block_tables=pick(meta.block_tables))


# A global layer's sliding window: longer than any sequence, so it hides no key. A kernel needs no
# sentinel of its own: any window at least the sequence's length sees every key.
NO_WINDOW = 1 << 30


class Attend(Protocol):
    def __call__(self, q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array, meta: StepMetadata,
                 *, sm_scale: float, sliding_window: jax.Array, soft_cap: float | None) -> jax.Array:
        """q [T, H, K] against slot `layer` (int32 scalar) of the pool [N, P, M, S, K] -> [T, H, K];
        `meta` holds one group's block tables [R, W] (`for_group`);
        `sliding_window` an int32 scalar (`NO_WINDOW` for a global layer)."""


def write_kv(kv, key, value, slot_mapping, layer):
    """Scatters the step's K/V into slot `layer` of the pool. key, value: [T, N, K]; slot_mapping: [T]
    (one group's)."""
    return _scatter(kv[0], key, slot_mapping, layer), _scatter(kv[1], value, slot_mapping, layer)


def _scatter(pool, new, slot_mapping, layer):
    """pool [N, P, M, S, K] with new [T, N, K] written at (layer, slots [T]); a uint16 pool holds
    bfloat16 bits. The write goes through a [N L, M S, K] view of the pool (a bitcast) with the
    two index arrays side by side, so XLA keeps the pool's layout and scatters in place."""
    n, l, m, s, k = pool.shape
    if pool.dtype == jnp.uint16:
        new = jax.lax.bitcast_convert_type(new.astype(jnp.bfloat16), jnp.uint16)
    new = new.swapaxes(0, 1).astype(pool.dtype)  # [N, T, K]
    if new.shape[1] == 1:
        # XLA turns a one-index scatter into a bounds-checked update that copies the whole pool
        # inside the layer loop (a step 30x slower), and so it does an update through
        # a reshaped view; a dynamic-update-slice of the pool's own shape updates in place.
        page, offset = slot_mapping[0] // s, slot_mapping[0] % s
        return jax.lax.dynamic_update_slice(pool, new[:, None, None], (0, layer, page, offset, 0))
    rows = jnp.arange(n) * l + layer  # [N]: the layer's heads in the flat view
    flat = pool.reshape(n * l, m * s, k).at[rows[:, None], slot_mapping[None, :]].set(new)
    return flat.reshape(n, l, m, s, k)
