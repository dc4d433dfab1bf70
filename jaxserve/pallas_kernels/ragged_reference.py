"""Ragged paged attention: the contract every backend meets, its input checks, and the plain-jnp
implementation that is both the kernels' reference and the engine's attention on CPU (there with
its decode rows computed by a C++ kernel where one builds: `decode_rows`, `jaxserve.cpu_kernels`).

One call serves a whole engine step: decode rows and prompt chunks of many sequences, flattened
into one token axis. Sequence s owns the query rows `query_start[s] : query_start[s + 1]` and
holds `kv_lens[s]` tokens after this step, so its query row i sits at position
`kv_lens[s] - q_len[s] + i` and sees the keys at positions `<= its own` (and `> own - window`
with a sliding window). Its keys live in the paged pool, found through `block_tables[s]`; the
step's new K/V are already written there. Only the first `num_seqs[0]` sequences are real; rows
that no real sequence owns (token padding) come back as zeros, and so does a row that sees no key.

  q            [T, H, D]     queries, float32 or bfloat16
  k/v_pages    [N, M, P, D]  one layer of the pool (page 0 is the null page), or the whole stacked
               [N, Λ, M, P, D] pool with `layer` (an int32 scalar) naming the layer to read:
               the pool is indexed in place, never sliced into a copy
  kv_lens      [S] int32     tokens of each sequence after the step (0 for padding sequences)
  block_tables [S, W] int32  page ids; entries past a sequence's pages point to page 0
  query_start  [S + 1] int32 cumulative query rows (non-decreasing, query_start[0] == 0)
  num_seqs     [1] int32     real sequences (the rest are padding)
  returns      [T, H, D]     in q's dtype

How the jnp version runs (XLA on CPU): never gathers a sequence's whole history at once. Decode
rows (one query row) are batched across sequences and a loop walks their pages a block at a time,
each sequence from the first block its window reaches, gathering just that block for every
sequence, with an online softmax in float32. Prompt chunks (more than one row) loop over
sequences, then over blocks of rows (wide ones while a chunk has many rows left, then short ones),
then over the key blocks those rows can see (causal and window bounds), so cost follows the real
lengths and the block-table width costs nothing.
`sliding_window` is a Python int, None, or an int32 scalar array (`NO_WINDOW`: none), so one
traced layer serves local and global layers alike.
Legend: Λ layers, T tokens, H query heads, N kv heads, G = H / N, D head dim, M pool pages, P page size,
S sequences, W pages per sequence, B pages per key block, L = B P keys per block, Q rows per block.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

NEG = -1e30  # finite "minus infinity": masked scores never make inf - inf = NaN
KEYS_PER_BLOCK = 64  # L: measured fastest for decode on XLA:CPU (16 to 128 keys tried)
ROWS_PER_BLOCK = 32  # Q: the rows of a prompt chunk's short remainder, against blocks of L keys
# A prompt chunk's rows go in blocks this tall while at least half a block of them is left, against
# key blocks this long: larger dots spread each block's gather and softmax over more work (a
# 256-row chunk at 4,096 tokens ran 2.4x faster than in 32 x 64 blocks on XLA:CPU).
WIDE_ROWS_PER_BLOCK = 256
WIDE_KEYS_PER_BLOCK = 128
NO_WINDOW = 1 << 30  # the sliding window of a global layer: longer than any sequence


def window_value(sliding_window) -> jax.Array:
    """The window as an int32 scalar (NO_WINDOW for None)."""
    return jnp.asarray(NO_WINDOW if sliding_window is None else sliding_window, jnp.int32)


def stacked_pool(k_pages, v_pages, layer):
    """(k, v, layer) with the pool stacked [N, Λ, M, P, D]: a single layer's pool gains Λ = 1."""
    if layer is None:
        return k_pages[:, None], v_pages[:, None], jnp.int32(0)
    return k_pages, v_pages, jnp.asarray(layer, jnp.int32)


def check_ragged_inputs(q, k_pages, v_pages, kv_lens, block_tables, query_start, num_seqs,
                        sliding_window=None, soft_cap=None, *, name: str, bits: bool = False,
                        layer=None) -> None:
    """Shapes, dtypes and options of a ragged attention call; raises ValueError naming the input.
    `bits`: the pool may also be uint16, holding bfloat16 bits (see `jaxserve.worker.kv_pool`); with
    `layer`, the pool is the stacked [layers, ...] one."""
    if q.ndim != 3:
        raise ValueError(f"{name}: q must be [tokens, heads, head_dim], got shape {q.shape}")
    layers = "" if layer is None else "layers, "
    if k_pages.ndim != 4 + (layer is not None) or k_pages.shape != v_pages.shape:
        raise ValueError(f"{name}: k_pages and v_pages must both be [kv_heads, {layers}pages, page_size, head_dim], "
                         f"got {k_pages.shape} and {v_pages.shape}")
    kv_heads, head_dim = k_pages.shape[0], k_pages.shape[-1]
    if q.shape[2] != head_dim:
        raise ValueError(f"{name}: q head_dim {q.shape[2]} != k_pages head_dim {head_dim}")
    if q.shape[1] % kv_heads:
        raise ValueError(f"{name}: query heads {q.shape[1]} are not a multiple of kv heads {kv_heads}")
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"{name}: q must be float32 or bfloat16, got {q.dtype}")
    pool_dtypes = (jnp.float32, jnp.bfloat16) + ((jnp.uint16,) if bits else ())
    for arr, what in ((k_pages, "k_pages"), (v_pages, "v_pages")):
        if arr.dtype not in pool_dtypes:
            raise ValueError(f"{name}: {what} must be one of {[str(jnp.dtype(d)) for d in pool_dtypes]}, "
                             f"got {arr.dtype}")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"{name}: k_pages dtype {k_pages.dtype} != v_pages dtype {v_pages.dtype}")
    seqs = kv_lens.shape[0] if kv_lens.ndim == 1 else None
    if seqs is None or kv_lens.dtype != jnp.int32:
        raise ValueError(f"{name}: kv_lens must be int32 [sequences], got {kv_lens.dtype} {kv_lens.shape}")
    if block_tables.ndim != 2 or block_tables.shape[0] != seqs or block_tables.dtype != jnp.int32:
        raise ValueError(f"{name}: block_tables must be int32 [{seqs}, pages_per_seq], "
                         f"got {block_tables.dtype} {block_tables.shape}")
    if query_start.shape != (seqs + 1,) or query_start.dtype != jnp.int32:
        raise ValueError(f"{name}: query_start must be int32 [{seqs + 1}], got {query_start.dtype} {query_start.shape}")
    if num_seqs.shape != (1,) or num_seqs.dtype != jnp.int32:
        raise ValueError(f"{name}: num_seqs must be int32 [1], got {num_seqs.dtype} {num_seqs.shape}")
    if sliding_window is not None and not isinstance(sliding_window, jax.Array) and (
            not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{name}: sliding_window must be a positive int or None, got {sliding_window!r}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"{name}: soft_cap must be positive or None, got {soft_cap!r}")


def ragged_paged_attention_reference(q, k_pages, v_pages, kv_lens, block_tables, query_start, num_seqs, *,
                                     sm_scale: float | None = None, sliding_window: int | None = None,
                                     soft_cap: float | None = None, keys_per_block: int = KEYS_PER_BLOCK,
                                     rows_per_block: int = ROWS_PER_BLOCK,
                                     wide_block: tuple[int, int] = (WIDE_ROWS_PER_BLOCK, WIDE_KEYS_PER_BLOCK),
                                     layer=None, decode_rows=None) -> jax.Array:
    """Ragged paged attention in plain jnp (see the module docstring for the contract).
    `decode_rows`: what computes the decode rows in place of `_decode_rows` (its arguments, less
    `pages_per_block`), e.g. the engine's C++ kernel on a CPU (`jaxserve.cpu_kernels`)."""
    check_ragged_inputs(q, k_pages, v_pages, kv_lens, block_tables, query_start, num_seqs,
                        sliding_window, soft_cap, name="ragged_paged_attention_reference", bits=True, layer=layer)
    kv_lens, block_tables, query_start, num_seqs = map(jnp.asarray, (kv_lens, block_tables, query_start, num_seqs))
    k_pages, v_pages, layer = stacked_pool(k_pages, v_pages, layer)
    tokens, heads, head_dim = q.shape
    kv_heads, _, _, page_size, _ = k_pages.shape
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    pages_per_block = max(1, keys_per_block // page_size)  # B
    # Only the row blocks a chunk of `tokens` rows can use are traced, no taller than it: each
    # block's rows past the step are spare rows written per layer (a megabyte at 256 of them).
    wide_rows = wide_block[0] if tokens >= wide_block[0] // 2 else 0
    blocks = (min(rows_per_block, tokens), pages_per_block), (wide_rows, max(1, wide_block[1] // page_size))
    width = block_tables.shape[1]
    whole = math.lcm(*(b for _, b in blocks))
    tables = jnp.pad(block_tables, ((0, 0), (0, -(-width // whole) * whole - width)))  # slices never clamp
    q_len = query_start[1:] - query_start[:-1]  # [S]
    real = jnp.arange(kv_lens.shape[0]) < num_seqs[0]
    options = dict(scale=scale, window=window_value(sliding_window), soft_cap=soft_cap, layer=layer)

    spare = max(rows for rows, _ in blocks) if tokens > 1 else 0  # one row: no chunk, no spare rows
    out = jnp.zeros((tokens + spare, heads, head_dim), jnp.float32)  # spare rows: slices never clamp
    is_decode = real & (q_len == 1)
    decode = decode_rows or functools.partial(_decode_rows, pages_per_block=pages_per_block)
    decoded = decode(q[jnp.clip(query_start[:-1], 0, tokens - 1)], k_pages, v_pages,
                     jnp.where(is_decode, kv_lens, 0), tables, **options)  # [S, H, D]
    out = out.at[jnp.where(is_decode, query_start[:-1], tokens + spare)].set(decoded, mode="drop")
    if tokens > 1:
        out = _chunk_rows(out, q, k_pages, v_pages, kv_lens, tables, query_start, real & (q_len > 1),
                          blocks=blocks, **options)
    return out[:tokens].astype(q.dtype)


def as_values(pages):
    """Pool pages in their value dtype: uint16 bits reinterpreted as bfloat16."""
    return lax.bitcast_convert_type(pages, jnp.bfloat16) if pages.dtype == jnp.uint16 else pages


def _gather(k_pages, v_pages, layer, pages):
    """This block's pages [N, *pages.shape, P, D] of layer `layer`, and only them, in their value
    dtype: one gather from the stacked pool, whose layers and heads are flattened into one axis so
    that no layer's slice is ever copied out. The barrier keeps XLA from hoisting a conversion of a
    bfloat16 pool out of the loop, which would convert the whole pool per layer."""
    kv_heads, layers, num_pages, page_size, head_dim = k_pages.shape
    rows = (jnp.arange(kv_heads) * layers + layer).reshape((kv_heads,) + (1,) * pages.ndim)
    flat = lambda pool: pool.reshape(kv_heads * layers, num_pages, page_size, head_dim)  # noqa: E731
    k, v = lax.optimization_barrier((flat(k_pages)[rows, pages[None]], flat(v_pages)[rows, pages[None]]))
    return as_values(k), as_values(v)


def _dot(a, b, spec):
    """einsum against a block of the pool in float32: a bfloat16 block meets the other operand cast
    to bfloat16 (XLA's fast form, about 1.5x the speed of converting the block), float32 at full
    precision."""
    if b.dtype == jnp.bfloat16:
        return jnp.einsum(spec, a.astype(jnp.bfloat16), b, preferred_element_type=jnp.float32)
    return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST)


def _scores(q, k, scale, soft_cap):
    """q [..., R, D] . k [..., L, D] in float32 -> [..., R, L], scaled and soft-capped."""
    s = _dot(q, k, "...rd,...ld->...rl") * scale
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def _online_softmax(carry, s, visible, v):
    """Folds one key block into (acc [..., R, D], max [..., R], sum [..., R]): scores s [..., R, L],
    visible broadcastable to s, values v [..., L, D]."""
    acc, m, l = carry
    s = jnp.where(visible, s, NEG)
    m_new = jnp.maximum(m, s.max(-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
    pv = _dot(p, v, "...rl,...ld->...rd")
    return acc * alpha[..., None] + pv, m_new, l * alpha + p.sum(-1)


def _finish(acc, l):
    """acc / l, and zeros for a row that saw no key."""
    return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)


def _decode_rows(q, k_pages, v_pages, lengths, tables, *, scale, window, soft_cap, pages_per_block, layer):
    """One query per sequence at position lengths - 1 (0: none). q [S, H, D] -> [S, H, D] float32."""
    seqs, heads, head_dim = q.shape
    kv_heads, _, _, page_size, _ = k_pages.shape
    keys = pages_per_block * page_size  # L
    qg = q.reshape(seqs, kv_heads, heads // kv_heads, head_dim).swapaxes(0, 1).astype(jnp.float32)  # [N, S, G, D]
    # Each sequence walks its own blocks from the first one its window reaches: sequences of
    # different lengths under a sliding window then cost a window each, not the span of them all.
    first = jnp.maximum(lengths - window, 0) // keys  # [S]
    blocks = ((lengths + keys - 1) // keys - first).max()

    def block(i, carry):
        column = (first + i)[:, None] * pages_per_block + jnp.arange(pages_per_block)  # [S, B]
        pages = jnp.take_along_axis(tables, jnp.minimum(column, tables.shape[1] - 1), axis=1)  # past the end: masked
        k, v = _gather(k_pages, v_pages, layer, pages)
        k = k.reshape(kv_heads, seqs, keys, head_dim)  # [N, S, L, D]
        v = v.reshape(kv_heads, seqs, keys, head_dim)
        pos = (first + i)[:, None] * keys + jnp.arange(keys)  # [S, L]
        visible = (pos < lengths[:, None]) & (pos >= lengths[:, None] - window)
        return _online_softmax(carry, _scores(qg, k, scale, soft_cap), visible[None, :, None, :], v)

    init = (jnp.zeros(qg.shape, jnp.float32), jnp.full(qg.shape[:-1], NEG), jnp.zeros(qg.shape[:-1]))
    acc, _, l = lax.fori_loop(0, blocks, block, init)
    return _finish(acc, l).swapaxes(0, 1).reshape(seqs, heads, head_dim)


def _chunk_rows(out, q, k_pages, v_pages, kv_lens, tables, query_start, is_chunk, *, blocks, scale, window,
                soft_cap, layer):
    """Writes into out [T + Q', H, D] the rows of every sequence with is_chunk set: `blocks` is
    ((Q, B), (Q', B')), a chunk's rows go Q' at a time against B' pages while at least Q' / 2 rows
    are left (the last such block may be part empty; none with Q' = 0), then Q at a time against B
    pages."""
    tokens, heads, head_dim = q.shape
    kv_heads, _, _, page_size, _ = k_pages.shape
    group = heads // kv_heads
    (short_rows, _), (wide_rows, _) = blocks
    q = jnp.pad(q, ((0, max(short_rows, wide_rows)), (0, 0), (0, 0)))
    chunk_seqs = jnp.nonzero(is_chunk, size=is_chunk.shape[0], fill_value=0)[0]

    def sequence(j, out):
        s = chunk_seqs[j]
        first, q_len = query_start[s], query_start[s + 1] - query_start[s]
        start = kv_lens[s] - q_len  # position of the chunk's first row
        table = tables[s]

        def row_block(rows, pages_per_block, r, out):
            """Rows r : r + rows of the chunk (those below q_len) against blocks of pages_per_block pages."""
            keys = pages_per_block * page_size
            qb = lax.dynamic_slice_in_dim(q, first + r, rows).astype(jnp.float32)  # [Q, H, D]
            qb = qb.reshape(rows, kv_heads, group, head_dim).transpose(1, 2, 0, 3)  # [N, G, Q, D]
            i = r + jnp.arange(rows)
            valid = i < q_len
            q_pos = start + i  # [Q]
            last = start + jnp.minimum(r + rows, q_len) - 1
            hi = last // keys + 1
            lo = jnp.maximum(start + r - window + 1, 0) // keys

            def block(kb, carry):
                pages = lax.dynamic_slice_in_dim(table, kb * pages_per_block, pages_per_block)  # [B]
                k, v = _gather(k_pages, v_pages, layer, pages)
                k = k.reshape(kv_heads, 1, keys, head_dim)  # [N, 1, L, D]
                v = v.reshape(kv_heads, 1, keys, head_dim)
                k_pos = kb * keys + jnp.arange(keys)
                visible = (k_pos[None, :] <= q_pos[:, None]) & valid[:, None]  # [Q, L]
                visible &= k_pos[None, :] > q_pos[:, None] - window
                return _online_softmax(carry, _scores(qb, k, scale, soft_cap), visible, v)

            init = (jnp.zeros(qb.shape, jnp.float32), jnp.full(qb.shape[:-1], NEG), jnp.zeros(qb.shape[:-1]))
            acc, _, l = lax.fori_loop(lo, hi, block, init)
            result = _finish(acc, l).transpose(2, 0, 1, 3).reshape(rows, heads, head_dim)  # [Q, H, D]
            old = lax.dynamic_slice_in_dim(out, first + r, rows)
            return lax.dynamic_update_slice_in_dim(out, jnp.where(valid[:, None, None], result, old), first + r,
                                                   axis=0)

        done = 0
        if wide_rows:
            wide = q_len // wide_rows + (q_len % wide_rows >= wide_rows // 2)  # wide blocks
            done = jnp.minimum(wide * wide_rows, q_len)  # rows they cover
            out = lax.fori_loop(0, wide, lambda b, out: row_block(*blocks[1], b * wide_rows, out), out)
        return lax.fori_loop(0, (q_len - done + short_rows - 1) // short_rows,
                             lambda b, out: row_block(*blocks[0], done + b * short_rows, out), out)

    return lax.fori_loop(0, is_chunk.sum(), sequence, out)
