"""Chunked-prefill attention over the paged KV pool: a GPU-style Pallas kernel and its reference.

Where it sits in the engine: a prefill step (whole prompt or one chunk of it) first writes the
chunk's K/V into the slot's pages, then calls this with the chunk's queries. Query t of slot s sits
at position `starts[s] + t` and sees every earlier token of its sequence already in the pool plus
the chunk causally (keys j <= its position), optionally only the last `sliding_window` of them.
Rows t >= chunk_lens[s] are padding (bucketed shapes) and come back as zeros. A whole prompt is the
case `starts == 0`.

Signature (same for kernel and reference):
  prefill_attention(q, k_pages, v_pages, block_tables, starts, chunk_lens, *,
                    sm_scale=None, sliding_window=None, soft_cap=None, interpret=False, ...)
  q            [S, C, H, D]   queries of the chunk (any float32/bfloat16)
  k/v_pages    [K, N, P, D]   one layer of the paged pool, already holding the chunk's K/V
  block_tables [S, T] int32   page ids per slot; padded entries point to the null page 0
  starts       [S] int32      position of the chunk's first token (tokens already cached)
  chunk_lens   [S] int32      valid query rows (0 <= chunk_lens <= C); a slot with 0 is all zeros
  returns      [S, C, H, D]   in q's dtype
Precondition: `starts[s] + chunk_lens[s] <= T * P`.

The kernel uses the same Triton-style lowering as `paged_attention.py` (see its docstring for why
and for the pinned jax range). Grid is (slot, kv_head, query block); the G query heads sharing a kv
head are folded into the rows of one block (row r = t * G' + g), so each key page is loaded once
per query block for all of them. The key loop runs only over the blocks that hold a visible key:
from the sliding-window start of the block's first query to its last query's position.

Dimension legend:
  S  slots          C  chunk (query tokens per slot, padded)   H  query heads   K  kv heads
  G  H // K         G' G padded to a power of two              D  head_dim
  N  pages in pool  P  page_size     T  pages per sequence     B  pages per key block
  L  keys per block (B * P)          Q  query tokens per query block   R  rows per block (Q * G')
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxserve.pallas_kernels.paged_attention import (
    _MIN_DOT, _dot_precision, _is_pow2, _next_pow2, check_options, check_paged_inputs,
    online_softmax_init, online_softmax_result, online_softmax_update)

# ----------------------------------------------------------------------------------------------
# Kernel (one program per (slot, kv_head, query block))
# ----------------------------------------------------------------------------------------------


def _prefill_kernel(
    starts_ref,  # [1] int32: position of the chunk's first token
    chunk_lens_ref,  # [1] int32: valid query tokens in the chunk
    block_table_ref,  # [T'] int32: this slot's page ids (padded to a multiple of B)
    q_ref,  # [R, D]: Q query tokens x G' heads, row r = t * G' + g
    k_ref,  # [N, P, D]: this kv head's key pages
    v_ref,  # [N, P, D]: this kv head's value pages
    o_ref,  # [R, D]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    pages_per_block: int,
    group: int,  # G'
):
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    block_len = pages_per_block * page_size  # L
    block_q = rows // group  # Q
    start = starts_ref[0]
    chunk_len = chunk_lens_ref[0]
    t0 = pl.program_id(2) * block_q  # first chunk row of this block

    q = q_ref[...]  # [R, D]
    precision = _dot_precision(q.dtype)
    t = t0 + jnp.arange(rows, dtype=jnp.int32) // group  # [R] chunk row of each block row
    q_pos = start + t  # [R]
    row_valid = t < chunk_len  # [R]

    # Keys needed by the valid rows of this block: [first visible of first row, last row].
    n_valid = jnp.clip(chunk_len - t0, 0, block_q)
    hi = jnp.where(n_valid > 0, (start + t0 + n_valid + block_len - 1) // block_len, 0)
    hi = jnp.minimum(hi, block_table_ref.shape[0] // pages_per_block)  # never past the table
    if sliding_window is None:
        lo = jnp.int32(0)
    else:
        lo = jnp.minimum(jnp.maximum(start + t0 - sliding_window + 1, 0) // block_len, hi)

    def body(b, carry):
        acc, m, l = carry  # [R, D] f32, [R] f32, [R] f32
        page_ids = block_table_ref[pl.ds(b * pages_per_block, pages_per_block)]  # [B]
        k = k_ref[page_ids].reshape(block_len, head_dim)  # [L, D]
        v = v_ref[page_ids].reshape(block_len, head_dim)  # [L, D]
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())),
            precision=precision, preferred_element_type=jnp.float32,
        ) * sm_scale  # [R, L]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = b * block_len + jnp.arange(block_len, dtype=jnp.int32)  # [L]
        visible = (k_pos[None, :] <= q_pos[:, None]) & row_valid[:, None]  # [R, L]
        if sliding_window is not None:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        return online_softmax_update(s, visible, v, acc, m, l, precision)

    acc, _, l = lax.fori_loop(lo, hi, body, online_softmax_init(rows, head_dim))
    o_ref[...] = online_softmax_result(acc, l).astype(o_ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_call wrapper
# ----------------------------------------------------------------------------------------------


def _check_prefill_inputs(q, k_pages, v_pages, block_tables, starts, chunk_lens):
    name = "prefill_attention"
    check_paged_inputs(q, k_pages, v_pages, block_tables, chunk_lens, q_rank=4, name=name)
    if starts.shape != chunk_lens.shape or starts.dtype != jnp.int32:
        raise ValueError(
            f"{name}: starts must be int32 [{q.shape[0]}], got {starts.dtype} {starts.shape}")


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "pages_per_block", "block_q",
                     "interpret", "num_warps", "num_stages"))
def _prefill_attention_jit(q, k_pages, v_pages, block_tables, starts, chunk_lens, *, sm_scale,
                           sliding_window, soft_cap, pages_per_block, block_q, interpret,
                           num_warps, num_stages):
    slots, chunk, q_heads, head_dim = q.shape  # [S, C, H, D]
    kv_heads, num_pages, page_size, _ = k_pages.shape  # [K, N, P, D]
    group = q_heads // kv_heads
    gp = _next_pow2(group)  # G'
    rows = block_q * gp
    chunk_p = pl.cdiv(chunk, block_q) * block_q
    # [S, C, H, D] -> [S, C', K, G', D] -> [S, K, C' * G', D]
    q5 = q.reshape(slots, chunk, kv_heads, group, head_dim)
    q5 = jnp.pad(q5, ((0, 0), (0, chunk_p - chunk), (0, 0), (0, gp - group), (0, 0)))
    qr = q5.transpose(0, 2, 1, 3, 4).reshape(slots, kv_heads, chunk_p * gp, head_dim)
    pages_per_seq = block_tables.shape[1]
    padded = pl.cdiv(pages_per_seq, pages_per_block) * pages_per_block
    bt = jnp.pad(block_tables, ((0, 0), (0, padded - pages_per_seq)))  # [S, T']

    kernel = functools.partial(
        _prefill_kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        pages_per_block=pages_per_block, group=gp)
    out = pl.pallas_call(
        kernel,
        grid=(slots, kv_heads, chunk_p // block_q),
        in_specs=[
            pl.BlockSpec((1,), lambda s, h, i: (s,)),  # starts
            pl.BlockSpec((1,), lambda s, h, i: (s,)),  # chunk_lens
            pl.BlockSpec((None, padded), lambda s, h, i: (s, 0)),  # block table row
            pl.BlockSpec((None, None, rows, head_dim), lambda s, h, i: (s, h, i, 0)),  # q
            pl.BlockSpec((None, num_pages, page_size, head_dim), lambda s, h, i: (h, 0, 0, 0)),
            pl.BlockSpec((None, num_pages, page_size, head_dim), lambda s, h, i: (h, 0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, rows, head_dim), lambda s, h, i: (s, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxserve_paged_prefill",
    )(starts, chunk_lens, bt, qr, k_pages, v_pages)
    # [S, K, C' * G', D] -> [S, C, H, D]
    out = out.reshape(slots, kv_heads, chunk_p, gp, head_dim)[:, :, :chunk, :group]
    return out.transpose(0, 2, 1, 3, 4).reshape(slots, chunk, q_heads, head_dim)


def prefill_attention(
    q: jax.Array,  # [S, C, H, D]
    k_pages: jax.Array,  # [K, N, P, D]
    v_pages: jax.Array,  # [K, N, P, D]
    block_tables: jax.Array,  # [S, T] int32
    starts: jax.Array,  # [S] int32
    chunk_lens: jax.Array,  # [S] int32
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """Causal attention of a prefill chunk against its sequence in the paged pool (Pallas kernel).

    See the module docstring for the contract. `block_q` (power of two) is the number of query
    tokens per program, default so that a block has >= 16 rows (at most 64 tokens);
    `pages_per_block` (power of two) is the pages per key block, default so it holds >= 16 keys.
    Raises ValueError on bad shapes, ranks, dtypes or options.
    """
    _check_prefill_inputs(q, k_pages, v_pages, block_tables, starts, chunk_lens)
    check_options(sliding_window, soft_cap, "prefill_attention")
    page_size, head_dim = k_pages.shape[2], k_pages.shape[3]
    chunk, group = q.shape[1], q.shape[2] // k_pages.shape[0]
    gp = _next_pow2(group)
    if block_q is None:
        block_q = max(max(1, _MIN_DOT // gp), min(64, _next_pow2(chunk)))
    if pages_per_block is None:
        pages_per_block = max(1, _MIN_DOT // page_size)
    if not _is_pow2(block_q) or not _is_pow2(pages_per_block):
        raise ValueError(f"prefill_attention: block_q ({block_q}) and pages_per_block "
                         f"({pages_per_block}) must be powers of two")
    sm_scale = float(1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale)
    return _prefill_attention_jit(
        q, k_pages, v_pages, block_tables, starts, chunk_lens, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=None if soft_cap is None else float(soft_cap),
        pages_per_block=pages_per_block, block_q=block_q, interpret=interpret,
        num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------------------------
# Plain-jnp reference
# ----------------------------------------------------------------------------------------------


def prefill_attention_reference(
    q: jax.Array,  # [S, C, H, D]
    k_pages: jax.Array,  # [K, N, P, D]
    v_pages: jax.Array,  # [K, N, P, D]
    block_tables: jax.Array,  # [S, T] int32
    starts: jax.Array,  # [S] int32
    chunk_lens: jax.Array,  # [S] int32
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Same contract as `prefill_attention`, by gathering every page of every slot (XLA)."""
    slots, chunk, q_heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    width = block_tables.shape[1] * page_size
    k = k_pages[:, block_tables].reshape(kv_heads, slots, width, head_dim)  # [K, S, W, D]
    v = v_pages[:, block_tables].reshape(kv_heads, slots, width, head_dim)  # [K, S, W, D]
    qg = q.reshape(slots, chunk, kv_heads, group, head_dim).astype(jnp.float32)  # [S,C,K,G,D]
    s = jnp.einsum("sckgd,kswd->sckgw", qg, k.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST) * scale  # [S, C, K, G, W]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    t = jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [1, C]
    q_pos = (starts[:, None] + t)[:, :, None]  # [S, C, 1]
    k_pos = jnp.arange(width, dtype=jnp.int32)[None, None, :]  # [1, 1, W]
    visible = (k_pos <= q_pos) & (t < chunk_lens[:, None])[:, :, None]  # [S, C, W]
    if sliding_window is not None:
        visible = visible & (k_pos > q_pos - sliding_window)
    visible = visible[:, :, None, None, :]  # [S, C, 1, 1, W]
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("sckgw,kswd->sckgd", p, v.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)  # [S, C, K, G, D]
    return o.reshape(slots, chunk, q_heads, head_dim).astype(q.dtype)
