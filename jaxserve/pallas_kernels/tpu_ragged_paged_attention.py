"""Ragged paged attention, TPU-style Pallas kernel (Mosaic): the same contract as the GPU kernel in
`ragged_paged_attention` and the plain-jnp `ragged_reference`, for the engine's step on a TPU.

How it differs from the GPU kernel. The small metadata (kv_lens, query_start and each query block's
first and last sequence) is scalar-prefetched into SMEM (`PrefetchScalarGridSpec`). The K/V pool
and the block tables stay in HBM (`memory_space=pl.ANY`: 512 sequences x 512 pages of table
already overflow the 1 MiB of SMEM) and the kernel copies what it needs itself: the table row of
each sequence into SMEM, and each key block, B pages, one DMA (`pltpu.make_async_copy`) per page,
into a [L, D] VMEM buffer. The grid is (kv head, query block); a program owns R = Q G rows (the G
query heads of its kv head x Q tokens, head-major: row g Q + t) whose online-softmax state (m, l,
acc) lives in VMEM scratch. As on GPU, it loops over the real sequences overlapping its block and,
per sequence, only over the key blocks its rows can see (causal upper bound, sliding-window lower
bound); rows of other sequences are masked, which leaves their state unchanged.

The copies form one chain per program: two key buffers, the next key block always on the way while
the current one is computed, across sequence edges too, and each table row fetched one sequence
ahead. So a program waits on memory once (its first block), not once per sequence, which matters
for decode, where a block holds many short sequences. A key block copies only the pages holding
keys that some row can see: no null pages past the end of a sequence (the table pads with them)
and none before the window; the value rows of pages not copied are zeroed, since stale VMEM may
hold NaN and 0 x NaN is NaN. Not done (yet): prefetch across programs.

Mosaic rules kept: a block's second-minor dim is a multiple of 8, so R = Q G is (ValueError
otherwise); m and l are stored lane-replicated ([R, 128]), the usual form for per-row softmax
state. Default blocks: Q = 32 tokens, L = 128 keys (B = 128 / P pages). Checked on CPU by
deviceless compiles (see the tests): on v5e and v6e, head_dim 32 to 256, page size 4 to 64, G 1
to 8, float32 and bfloat16 all compile; v4 and v5p (megacore) compile too.

On CPU it runs in the TPU interpreter (`interpret=True` passes `pltpu.InterpretParams()`; an
`InterpretParams` is passed through, e.g. to detect races), which is slow, so tests keep shapes
small. Pinned range: jax >= 0.10, < 0.12.

Legend: T tokens, H query heads, N kv heads, G = H / N, D head dim, M pool pages, P page size,
S sequences, W' pages per sequence padded to whole key blocks, B pages per key block, L = B P keys
per block, Q tokens per query block, R = Q G rows per program, K query blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxserve.pallas_kernels.ragged_paged_attention import (
    NEG, block_sequences, check_tuning, from_block_rows, pad_tables, resolve_scale, to_block_rows)
from jaxserve.pallas_kernels.ragged_reference import check_ragged_inputs, stacked_pool, window_value

LANES = 128  # lane width: m and l are stored replicated across it
SUBLANES = 8  # a block's second-minor dim is a multiple of this
TOKENS_PER_BLOCK = 32  # default Q
KEYS_PER_BLOCK = 128  # default L

# ----------------------------------------------------------------------------------------------
# Kernel: one program per (kv head, query block)
# ----------------------------------------------------------------------------------------------


def _tpu_ragged_kernel(
    first_ref,  # SMEM [K] int32: first real sequence overlapping each query block
    last_ref,  # SMEM [K] int32: last one (last < first: none)
    kv_lens_ref,  # SMEM [S] int32
    query_start_ref,  # SMEM [S + 1] int32
    layer_ref,  # SMEM [2] int32: the layer's first page in k_hbm (layer x M), its sliding window
    q_ref,  # VMEM [R, D]: this block's rows of this kv head, row g Q + t
    tables_hbm,  # HBM [S, W'] int32: block tables (too big for SMEM in a large batch)
    k_hbm,  # HBM [N, Λ M, P, D]: every layer's pages
    v_hbm,  # HBM [N, Λ M, P, D]
    o_ref,  # VMEM [R, D]
    table_rows,  # SMEM [2, W'] int32: block-table rows of sequences s (slot s % 2) and s + 1
    k_buf,  # VMEM [2, L, D]: double-buffered key block
    v_buf,  # VMEM [2, L, D]
    sems,  # DMA semaphores [3 (k, v, table row), 2 (slot)]
    m_ref,  # VMEM [R, 128] float32: running max, lane-replicated
    l_ref,  # VMEM [R, 128] float32: running sum
    acc_ref,  # VMEM [R, D] float32: running numerator
    *,
    block_q: int,
    pages_per_block: int,
    sm_scale: float,
    soft_cap: float | None,
):
    head, block = pl.program_id(0), pl.program_id(1)
    page0, sliding_window = layer_ref[0], layer_ref[1]
    keys = k_buf.shape[1]  # L
    page_size = keys // pages_per_block
    width = table_rows.shape[1]  # W'
    row0 = block * block_q  # flat token of the block's first row
    first, last = first_ref[block], last_ref[block]
    m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

    def key_range(s):
        """(lo, hi, page_lo, page_hi): the key blocks and the pages (indices into the sequence's
        table row) holding keys that the rows of sequence s in this query block can see."""
        start, end = query_start_ref[s], query_start_ref[s + 1]
        pos0 = kv_lens_ref[s] - (end - start)  # position of the sequence's row `start`
        lo_row, hi_row = jnp.maximum(start, row0), jnp.minimum(end, row0 + block_q)
        key_end = jnp.where(hi_row > lo_row, pos0 + hi_row - start, 0)  # last visible key + 1
        key_start = jnp.maximum(pos0 + lo_row - start - sliding_window + 1, 0)
        hi = jnp.minimum((key_end + keys - 1) // keys, width // pages_per_block)
        lo = jnp.minimum(key_start // keys, hi)
        return lo, hi, key_start // page_size, (key_end + page_size - 1) // page_size

    def table_row(s):
        return pltpu.make_async_copy(tables_hbm.at[s], table_rows.at[s % 2], sems.at[2, s % 2])

    def kv_copies(s, b, slot, pages, action):
        """Starts or waits (`action`) the page DMAs of key block b of sequence s into buffer
        `slot`: only pages in [page_lo, page_hi) (`pages`); the others would be null pages or
        keys out of the window, read for nothing, and `_attend` zeroes what is left of them."""
        page_lo, page_hi = pages
        for j in range(pages_per_block):
            index = b * pages_per_block + j

            @pl.when((index >= page_lo) & (index < page_hi))
            def _():
                page = page0 + table_rows[s % 2, index]
                rows_j = pl.ds(j * page_size, page_size)
                for src, buf, kind in ((k_hbm, k_buf, 0), (v_hbm, v_buf, 1)):
                    copy = pltpu.make_async_copy(src.at[head, page], buf.at[slot, rows_j], sems.at[kind, slot])
                    copy.start() if action == "start" else copy.wait()

    # The DMA chain. Each table row is started one sequence ahead and waited once; each key block
    # is started one block ahead, across sequence edges too: a sequence whose predecessor had key
    # blocks ("chained") finds its first block already on the way. Slots alternate per key block.
    @pl.when(first <= last)
    def _prologue():
        table_row(first).start()

    def sequence(s, step):  # step: key blocks done so far in this program (slot = step % 2)
        lo, hi, *pages = key_range(s)
        prev_lo, prev_hi, *_ = key_range(jnp.maximum(s - 1, first))
        chained = (s > first) & (prev_lo < prev_hi) & (lo < hi)

        @pl.when(jnp.logical_not(chained))
        def _own_start():
            table_row(s).wait()

            @pl.when(lo < hi)
            def _():
                kv_copies(s, lo, lax.rem(step, 2), pages, "start")

        @pl.when(s < last)
        def _next_row():
            table_row(s + 1).start()

        following = jnp.minimum(s + 1, last)
        next_lo, next_hi, *next_pages = key_range(following)
        chain_next = (s < last) & (next_lo < next_hi)

        def key_block(b, step):
            slot = lax.rem(step, 2)

            @pl.when(b + 1 < hi)
            def _next_block():
                kv_copies(s, b + 1, 1 - slot, pages, "start")

            @pl.when((b + 1 == hi) & chain_next)
            def _next_sequence():
                table_row(following).wait()
                kv_copies(following, next_lo, 1 - slot, next_pages, "start")

            kv_copies(s, b, slot, pages, "wait")
            _attend(s, b, slot, pages)
            return step + 1

        return lax.fori_loop(lo, hi, key_block, step)

    def _attend(s, b, slot, pages):
        start, end = query_start_ref[s], query_start_ref[s + 1]
        pos0 = kv_lens_ref[s] - (end - start)
        k, v = k_buf[slot], v_buf[slot]  # [L, D]
        # Keys of pages not copied hold stale bits (maybe NaN): their scores are masked below,
        # but 0 x NaN in P.V is not 0, so those value rows are zeroed.
        key = b * keys + lax.broadcasted_iota(jnp.int32, v.shape, 0)  # [L, D]
        copied = (key >= pages[0] * page_size) & (key < pages[1] * page_size)
        v = jnp.where(copied, v.astype(jnp.float32), 0.0).astype(v.dtype)
        scores = lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32) * sm_scale  # [R, L]
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        token = row0 + jnp.bitwise_and(lax.broadcasted_iota(jnp.int32, scores.shape, 0),
                                       block_q - 1)  # [R, L]: flat token of each row
        k_pos = b * keys + lax.broadcasted_iota(jnp.int32, scores.shape, 1)  # [R, L]
        q_pos = pos0 + token - start
        visible = (token >= start) & (token < end) & (k_pos <= q_pos) & (k_pos > q_pos - sliding_window)
        _online_softmax_update(scores, visible, v, m_ref, l_ref, acc_ref, precision)

    lax.fori_loop(first, last + 1, sequence, jnp.int32(0))
    l = l_ref[:, :1]  # [R, 1]
    o_ref[...] = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


def _online_softmax_update(s, visible, v, m_ref, l_ref, acc_ref, precision):
    """Folds scores s [R, L] (float32) and values v [L, D] into the state refs; rows with nothing
    visible keep their state exactly (alpha = 1, p = 0)."""
    s = jnp.where(visible, s, NEG)
    m_prev = m_ref[...]  # [R, 128]
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))  # [R, 128]
    alpha = jnp.exp(m_prev - m_new)  # [R, 128]
    p = jnp.where(visible, jnp.exp(s - m_new[:, :1]), 0.0)  # [R, L]
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
    m_ref[...] = m_new
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)  # [R, D]
    acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv


# ----------------------------------------------------------------------------------------------
# pallas_call wrapper
# ----------------------------------------------------------------------------------------------


def ragged_paged_attention_tpu(
    q: jax.Array,  # [T, H, D]
    k_pages: jax.Array,  # [N, M, P, D], or the stacked [N, Λ, M, P, D] with `layer`
    v_pages: jax.Array,  # likewise
    kv_lens: jax.Array,  # [S] int32
    block_tables: jax.Array,  # [S, W] int32
    query_start: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float | None = None,
    sliding_window=None,  # int, None or an int32 scalar
    soft_cap: float | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    layer=None,  # int32 scalar: the layer of a stacked pool
    block_q: int = TOKENS_PER_BLOCK,
    pages_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:  # [T, H, D]
    """Ragged paged attention (TPU Pallas kernel); the contract is `ragged_reference`'s.

    Tuning: `block_q` tokens per program (power of two, default 32; smaller suits decode-heavy
    steps, larger long prompts), `pages_per_block` pages per key block (power of two, default so a
    block holds 128 keys, at least one page), `vmem_limit_bytes` for Mosaic (default: the
    compiler's). `interpret=True` (or a `pltpu.InterpretParams`) runs it in the TPU interpreter.
    Raises ValueError on bad shapes, dtypes or options (`check_ragged_inputs`), on a query block
    of block_q x G rows that is not a multiple of 8, and on bad tuning values.
    """
    name = "ragged_paged_attention_tpu"
    check_ragged_inputs(q, k_pages, v_pages, kv_lens, block_tables, query_start, num_seqs,
                        sliding_window, soft_cap, name=name, layer=layer)
    k_pages, v_pages, layer = stacked_pool(k_pages, v_pages, layer)
    kv_heads, _, _, page_size, head_dim = k_pages.shape
    if pages_per_block is None:
        pages_per_block = max(1, KEYS_PER_BLOCK // page_size)
    check_tuning(name, block_q=block_q, pages_per_block=pages_per_block)
    rows = block_q * (q.shape[1] // kv_heads)
    if rows % SUBLANES:
        raise ValueError(f"{name}: a query block has block_q x group = {block_q} x "
                         f"{q.shape[1] // kv_heads} = {rows} rows, not a multiple of {SUBLANES} "
                         f"(Mosaic's rule for the second-minor dim of a block)")
    if vmem_limit_bytes is not None and (not isinstance(vmem_limit_bytes, int) or vmem_limit_bytes <= 0):
        raise ValueError(f"{name}: vmem_limit_bytes must be a positive int, got {vmem_limit_bytes!r}")
    return _tpu_jit(q, k_pages, v_pages, kv_lens, block_tables, query_start, num_seqs, layer,
                    window_value(sliding_window), sm_scale=resolve_scale(sm_scale, head_dim),
                    soft_cap=None if soft_cap is None else float(soft_cap), block_q=block_q,
                    pages_per_block=pages_per_block, vmem_limit_bytes=vmem_limit_bytes,
                    interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "block_q", "pages_per_block",
                                             "vmem_limit_bytes", "interpret"))
def _tpu_jit(q, k_pages, v_pages, kv_lens, block_tables, query_start, num_seqs, layer, window, *, sm_scale,
             soft_cap, block_q, pages_per_block, vmem_limit_bytes, interpret):
    tokens, heads, head_dim = q.shape
    kv_heads, layers, num_pages, page_size, _ = k_pages.shape
    # Every layer's pages of a kv head on one axis (a bitcast): the kernel copies its layer's
    # pages at an offset, and no layer's slice of the pool is copied out.
    k_pages = k_pages.reshape(kv_heads, layers * num_pages, page_size, head_dim)
    v_pages = v_pages.reshape(kv_heads, layers * num_pages, page_size, head_dim)
    layer_info = jnp.stack([layer * num_pages, window]).astype(jnp.int32)  # [2]
    group = heads // kv_heads
    rows = block_q * group  # R
    # Dots in the pool's dtype (float32 activations over a bfloat16 pool: q is rounded once
    # here); the output keeps q's dtype.
    q_rows = to_block_rows(q.astype(k_pages.dtype), kv_heads, block_q, group)  # [N, K R, D]
    num_blocks = q_rows.shape[1] // rows
    first, last = block_sequences(query_start, num_seqs, num_blocks, block_q)
    tables = pad_tables(block_tables, pages_per_block)  # [S, W']
    keys = pages_per_block * page_size

    kernel = functools.partial(_tpu_ragged_kernel, block_q=block_q, pages_per_block=pages_per_block,
                               sm_scale=sm_scale, soft_cap=soft_cap)
    rows_spec = pl.BlockSpec((None, rows, head_dim), lambda h, i, *_: (h, i, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)  # left in HBM: the kernel copies what it needs
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(kv_heads, num_blocks),
            in_specs=[rows_spec, hbm, hbm, hbm],
            out_specs=rows_spec,
            scratch_shapes=[
                pltpu.SMEM((2, tables.shape[1]), jnp.int32),
                pltpu.VMEM((2, keys, head_dim), k_pages.dtype),
                pltpu.VMEM((2, keys, head_dim), v_pages.dtype),
                pltpu.SemaphoreType.DMA((3, 2)),
                pltpu.VMEM((rows, LANES), jnp.float32),
                pltpu.VMEM((rows, LANES), jnp.float32),
                pltpu.VMEM((rows, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=vmem_limit_bytes),
        interpret=(interpret if isinstance(interpret, pltpu.InterpretParams)
                   else pltpu.InterpretParams() if interpret else False),
        name="jaxserve_ragged_paged_attention_tpu",
    )(first, last, kv_lens, query_start, layer_info, q_rows, tables, k_pages, v_pages)
    return from_block_rows(out, tokens, heads, block_q, group)
