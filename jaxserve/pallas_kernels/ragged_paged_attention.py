"""Ragged paged attention, GPU-style (Triton) Pallas kernel: one call per layer for a whole engine
step, decode rows and prompt chunks of many sequences on one flat token axis.

The contract (shapes, positions, masking, padding) is the one of `ragged_reference`, whose
`ragged_paged_attention_reference` is this kernel's plain-jnp reference and the engine's CPU
attention. In short: sequence s owns query rows `query_start[s] : query_start[s + 1]`, holds
`kv_lens[s]` tokens after the step (its new K/V already written into its pages), its row i sits at
position `kv_lens[s] - q_len[s] + i` and sees the keys at positions `<= own` (and `> own - window`).
Rows owned by no real sequence (s >= num_seqs[0], token padding) and rows that see no key are zeros.

How the kernel splits the work. The flat token axis is cut into blocks of `block_q` rows; the grid
is (query block, kv head, kv split). A program folds the G query heads that share its kv head into its rows
(G padded to a power of two, head-major: row r = g * Q + t), so every key block it loads serves all
of them. Before the call the wrapper finds, with `searchsorted` on `query_start`, the first and last
real sequence overlapping each block. The program loops over those sequences and, for each, over
only the key blocks its rows can see (up to the causal position of its last row in the block, from
the sliding-window start of its first row), folding them into one float32 online softmax over all
rows. Rows of other sequences are masked out of a sequence's scores, which leaves their running
softmax state exactly unchanged, so one state serves every sequence of the block and each output
row is written once. A decode-only block of Q sequences runs Q short key loops; a prompt chunk runs
a causal flash-attention; a mixed block does both, in one launch. A decode step has few query
blocks, so the grid has a third axis, C kv splits (flash-decoding): split c takes the c-th share of
each sequence's key blocks and writes its output with the log-sum-exp of its scores, and a jnp
merge weighs the splits into one softmax (C = 1 writes the output directly).

Why this GPU lowering. Pallas has two GPU back ends. In jax 0.10.x a bare `pl.pallas_call` lowers
to Mosaic GPU by default, and in 0.11.x `pl.pallas_call` for Mosaic GPU is deprecated in favour of
`plgpu.kernel`, whose warpgroup/TMA model targets Hopper and newer only. The Triton-style lowering
keeps the "one program per grid point, arrays are blocks" model, runs down to Ampere, and is chosen
explicitly by passing `pallas.triton.CompilerParams`, in both versions. It is marked deprecated
(0.11.0 changelog) but ships, hence the pinned range jax >= 0.10, < 0.12. On CPU the same kernel
runs with `interpret=True`, which is how the tests check it.

Triton rules the kernel respects: every block a program loads has power-of-two dimensions
(page_size, head_dim, rows R = Q * G', pages per key block), and a `dot` needs at least 16 rows and
columns, so R >= 16, keys per block L >= 16 and D >= 16.

Legend: T tokens (T' padded to whole query blocks), H query heads, N kv heads, G = H / N, G' = G
padded to a power of two, D head dim, M pool pages, P page size, S sequences (real + padding),
W pages per sequence (W' padded to whole key blocks), B pages per key block, L = B P keys per
block, Q query rows (tokens) per block, R = Q G' kernel rows per block, K query blocks (T' / Q),
C kv splits.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxserve.pallas_kernels.ragged_reference import (  # noqa: F401 (the reference, re-exported)
    check_ragged_inputs, ragged_paged_attention_reference, stacked_pool, window_value)

NEG = -1e30  # finite "minus infinity": masked scores never make inf - inf = NaN
MIN_DOT = 16  # Triton's smallest dot operand dimension
ROWS_PER_BLOCK = 32  # default R: Q = 32 // G' tokens per program (more programs for decode)
KEYS_PER_BLOCK = 64  # default L (at least one page)
PROGRAMS = 512  # default kv splits aim for this many programs (a few per multiprocessor)
# Shared memory one thread block may use, KiB, by CUDA compute capability (CUDA C++ Programming
# Guide, technical specifications; Triton opts in to the maximum). Triton keeps `num_stages` copies
# of each key block's K and V there: Gemma 3's head dim 256 in float32 asked 288 KiB at 64 keys per
# block and failed to compile on an H200 (227). Unknown capabilities get the smallest figure.
SHARED_MEMORY_KIB = {(7, 0): 96, (7, 5): 64, (8, 0): 163, (8, 6): 99, (8, 7): 163, (8, 9): 99,
                     (9, 0): 227, (10, 0): 227, (12, 0): 99}

# ----------------------------------------------------------------------------------------------
# Kernel: one program per (query block, kv head)
# ----------------------------------------------------------------------------------------------


def _ragged_kernel(
    first_ref,  # [1] int32: first real sequence overlapping this query block
    last_ref,  # [1] int32: last one (last < first: none, the block is all padding)
    kv_lens_ref,  # [S] int32
    query_start_ref,  # [S + 1] int32
    tables_ref,  # [S, W'] int32: block tables, padded with the null page to whole key blocks
    layer_ref,  # [2] int32: the layer's first page in k_ref (layer x M), its sliding window
    q_ref,  # [R, D]: Q tokens x G' heads of this kv head, row r = g * Q + t
    k_ref,  # [Λ M, P, D]: this kv head's key pages, every layer's
    v_ref,  # [Λ M, P, D]: this kv head's value pages
    o_ref,  # [R, D]: this split's output (normalized over its keys)
    *lse_ref,  # with kv splits: [R] float32 log-sum-exp of this split's scores (NEG: none seen)
    block_q: int,
    pages_per_block: int,
    kv_splits: int,
    sm_scale: float,
    soft_cap: float | None,
):
    rows, head_dim = q_ref.shape
    page0, sliding_window = layer_ref[0], layer_ref[1]
    page_size = k_ref.shape[1]
    keys = pages_per_block * page_size  # L
    max_blocks = tables_ref.shape[1] // pages_per_block
    row0 = pl.program_id(0) * block_q  # flat token index of the block's first row
    split = pl.program_id(2)  # read here: interpret mode cannot read it inside the loops
    token = row0 + jnp.arange(rows, dtype=jnp.int32) % block_q  # [R]: flat token of each row
    q = q_ref[...]  # [R, D]
    precision = _dot_precision(q.dtype)

    def sequence(s, carry):
        start, end = query_start_ref[s], query_start_ref[s + 1]
        pos0 = kv_lens_ref[s] - (end - start)  # position of the sequence's row `start`
        lo_row, hi_row = jnp.maximum(start, row0), jnp.minimum(end, row0 + block_q)  # its rows here
        mine = (token >= start) & (token < end)  # [R]
        q_pos = pos0 + token - start  # [R]
        # Key blocks those rows can see: up to the last row's position, from the first row's window.
        hi = jnp.where(hi_row > lo_row, (pos0 + hi_row - 1 - start) // keys + 1, 0)
        hi = jnp.minimum(hi, max_blocks)
        lo = jnp.minimum(jnp.maximum(pos0 + lo_row - start - sliding_window + 1, 0) // keys, hi)
        if kv_splits > 1:  # this program's share of those key blocks
            share = (hi - lo + kv_splits - 1) // kv_splits
            lo = jnp.minimum(lo + split * share, hi)
            hi = jnp.minimum(lo + share, hi)

        def key_block(b, carry):
            page_ids = page0 + tables_ref[s, pl.ds(b * pages_per_block, pages_per_block)]  # [B]
            k = k_ref[page_ids].reshape(keys, head_dim)  # [L, D]
            v = v_ref[page_ids].reshape(keys, head_dim)  # [L, D]
            scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32) * sm_scale  # [R, L]
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            k_pos = b * keys + jnp.arange(keys, dtype=jnp.int32)  # [L]
            visible = mine[:, None] & (k_pos[None, :] <= q_pos[:, None])  # [R, L]
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
            return online_softmax_update(carry, scores, visible, v, precision)

        return lax.fori_loop(lo, hi, key_block, carry)

    init = online_softmax_init(rows, head_dim)
    acc, m, l = lax.fori_loop(first_ref[0], last_ref[0] + 1, sequence, init)
    o_ref[...] = online_softmax_result(acc, l).astype(o_ref.dtype)
    if lse_ref:
        lse_ref[0][...] = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), NEG)


def merge_splits(out, lse):
    """Combines per-split outputs [C, ...rows, D] (each normalized over its own keys) by their
    log-sum-exps [C, ...rows] into one softmax over all keys; rows no split saw stay zero."""
    weight = jnp.exp(lse - lse.max(axis=0))  # [C, ...rows]: each split's share of the row's mass
    return (weight[..., None] * out).sum(axis=0) / weight.sum(axis=0)[..., None]


def online_softmax_init(rows: int, head_dim: int):
    """(acc [R, D], running max m [R], running sum l [R]) before any key block."""
    return (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def online_softmax_update(carry, s, visible, v, precision):
    """Folds one key block into (acc, m, l): scores s [R, L] float32, visible [R, L], values
    v [L, D]. A row with nothing visible keeps its state exactly (alpha = 1, p = 0)."""
    acc, m, l = carry
    s = jnp.where(visible, s, NEG)
    m_new = jnp.maximum(m, s.max(axis=1))  # [R]
    alpha = jnp.exp(m - m_new)  # [R]: rescales what was accumulated under the old max
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)  # [R, L]
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)  # [R, D]
    return acc * alpha[:, None] + pv, m_new, l * alpha + p.sum(axis=1)


def online_softmax_result(acc, l):
    """acc / l per row; a row that saw no key (l == 0) gets zeros, never 0 / 0."""
    return jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)


def _dot_precision(dtype) -> lax.Precision | None:
    """float32 dots at full precision (no TF32); bf16 dots take the native path."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


# ----------------------------------------------------------------------------------------------
# pallas_call wrapper
# ----------------------------------------------------------------------------------------------


def ragged_paged_attention(
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
    interpret: bool = False,
    layer=None,  # int32 scalar: the layer of a stacked pool
    block_q: int | None = None,
    pages_per_block: int | None = None,
    kv_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:  # [T, H, D]
    """Ragged paged attention (GPU Pallas kernel); the contract is `ragged_reference`'s.

    Tuning: `block_q` query tokens per program (power of two; default so a program has
    `ROWS_PER_BLOCK` = 32 rows of tokens x padded heads, and at least 16), `pages_per_block` pages
    per key block (power of two; default so a block holds `KEYS_PER_BLOCK` = 64 keys, at least one
    page), `kv_splits` programs sharing each (query block, kv head)'s keys (flash-decoding: a
    decode step has few query blocks, so without splits most of the GPU idles; default: enough
    splits for about `PROGRAMS` programs, 1 in interpret mode), Triton's `num_warps` and
    `num_stages`. `interpret=True` runs it on CPU.
    q may be float32 over a bfloat16 pool: the dots run in the pool's dtype, the output is in q's.
    Raises ValueError on bad shapes, dtypes or options (`check_ragged_inputs`), on a page size or
    head dim that is not a power of two (head dim >= 16), on fewer than 16 rows or keys per
    block, and on bad tuning values.
    """
    name = "ragged_paged_attention"
    check_ragged_inputs(q, k_pages, v_pages, kv_lens, block_tables, query_start, num_seqs,
                        sliding_window, soft_cap, name=name, layer=layer)
    k_pages, v_pages, layer = stacked_pool(k_pages, v_pages, layer)
    kv_heads, _, _, page_size, head_dim = k_pages.shape
    group_p = next_pow2(q.shape[1] // kv_heads)  # G'
    if not is_pow2(page_size) or not is_pow2(head_dim) or head_dim < MIN_DOT:
        raise ValueError(f"{name}: page_size ({page_size}) and head_dim ({head_dim}) must be powers "
                         f"of two, head_dim >= {MIN_DOT} (Triton blocks and dots)")
    if block_q is None:
        block_q = max(1, ROWS_PER_BLOCK // group_p, MIN_DOT // group_p)
    if pages_per_block is None:
        shared = None if interpret else shared_memory_bytes()
        pages_per_block = default_pages_per_block(page_size, head_dim, k_pages.dtype.itemsize,
                                                  block_q * group_p, num_stages, shared)
    check_tuning(name, block_q=block_q, pages_per_block=pages_per_block)
    if block_q * group_p < MIN_DOT or pages_per_block * page_size < MIN_DOT:
        raise ValueError(f"{name}: a program needs >= {MIN_DOT} rows (block_q {block_q} x padded "
                         f"group {group_p}) and >= {MIN_DOT} keys per block (pages_per_block "
                         f"{pages_per_block} x page_size {page_size}) for Triton dots")
    if kv_splits is None:
        blocks = -(-q.shape[0] // block_q) * kv_heads
        kv_splits = 1 if interpret else max(1, min(PROGRAMS // blocks, -(-block_tables.shape[1] // pages_per_block)))
    for what, value in (("num_warps", num_warps), ("num_stages", num_stages), ("kv_splits", kv_splits)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {what} must be a positive int, got {value!r}")
    return _ragged_jit(
        q, k_pages, v_pages, kv_lens, block_tables, query_start, num_seqs, layer, window_value(sliding_window),
        sm_scale=resolve_scale(sm_scale, head_dim),
        soft_cap=None if soft_cap is None else float(soft_cap), block_q=block_q,
        pages_per_block=pages_per_block, kv_splits=kv_splits, interpret=interpret,
        num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "block_q", "pages_per_block", "kv_splits",
                                             "interpret", "num_warps", "num_stages"))
def _ragged_jit(q, k_pages, v_pages, kv_lens, block_tables, query_start, num_seqs, layer, window, *, sm_scale,
                soft_cap, block_q, pages_per_block, kv_splits, interpret, num_warps, num_stages):
    tokens, heads, head_dim = q.shape
    kv_heads, layers, num_pages, page_size, _ = k_pages.shape
    # Every layer's pages of a kv head on one axis (a bitcast): the kernel reads its layer's pages
    # in place at an offset, and no layer's slice of the pool is copied out.
    k_pages = k_pages.reshape(kv_heads, layers * num_pages, page_size, head_dim)
    v_pages = v_pages.reshape(kv_heads, layers * num_pages, page_size, head_dim)
    layer_info = jnp.stack([layer * num_pages, window]).astype(jnp.int32)  # [2]
    group_p = next_pow2(heads // kv_heads)
    rows = block_q * group_p  # R
    # Dots in the pool's dtype (float32 activations over a bfloat16 pool: q is rounded once
    # here); the output keeps q's dtype.
    q_rows = to_block_rows(q.astype(k_pages.dtype), kv_heads, block_q, group_p)  # [N, K R, D]
    num_blocks = q_rows.shape[1] // rows  # K
    first, last = block_sequences(query_start, num_seqs, num_blocks, block_q)  # [K], [K]
    tables = pad_tables(block_tables, pages_per_block)  # [S, W']
    seqs, width = tables.shape

    kernel = functools.partial(_ragged_kernel, block_q=block_q, pages_per_block=pages_per_block,
                               kv_splits=kv_splits, sm_scale=sm_scale, soft_cap=soft_cap)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, h, c: (0,) * len(shape))  # noqa: E731
    pages = pl.BlockSpec((None, layers * num_pages, page_size, head_dim), lambda i, h, c: (h, 0, 0, 0))
    # One split writes the output directly; several write float32 partials merged below.
    out_specs = [pl.BlockSpec((None, None, rows, head_dim), lambda i, h, c: (c, h, i, 0))]
    out_shape = [jax.ShapeDtypeStruct((kv_splits, *q_rows.shape), q.dtype if kv_splits == 1 else jnp.float32)]
    if kv_splits > 1:
        out_specs.append(pl.BlockSpec((None, None, rows), lambda i, h, c: (c, h, i)))
        out_shape.append(jax.ShapeDtypeStruct((kv_splits, *q_rows.shape[:2]), jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=(num_blocks, kv_heads, kv_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda i, h, c: (i,)),  # first
            pl.BlockSpec((1,), lambda i, h, c: (i,)),  # last
            whole((seqs,)),  # kv_lens
            whole((seqs + 1,)),  # query_start
            whole((seqs, width)),  # tables
            whole((2,)),  # layer_info
            pl.BlockSpec((None, rows, head_dim), lambda i, h, c: (h, i, 0)),  # q
            pages,  # k
            pages,  # v
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxserve_ragged_paged_attention",
    )(first, last, kv_lens, query_start, tables, layer_info, q_rows, k_pages, v_pages)
    merged = out[0][0] if kv_splits == 1 else merge_splits(*out).astype(q.dtype)
    return from_block_rows(merged, tokens, heads, block_q, group_p)


# Helpers shared with the TPU variant.


def is_pow2(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def resolve_scale(sm_scale, head_dim: int) -> float:
    return float(1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale)


def default_pages_per_block(page_size: int, head_dim: int, itemsize: int, rows: int, num_stages: int,
                            shared_bytes: int | None) -> int:
    """Pages per key block: `KEYS_PER_BLOCK` keys (at least one page), halved while the block's
    pipelined K and V with the program's q rows overflow `shared_bytes` (None: no limit)."""
    pages = max(1, KEYS_PER_BLOCK // page_size)
    def needed(pages):  # bytes, as Triton asked in the H200 failure above
        return (2 * num_stages * pages * page_size + rows) * head_dim * itemsize
    while shared_bytes is not None and pages > 1 and pages * page_size > MIN_DOT and needed(pages) > shared_bytes:
        pages //= 2
    return pages


@functools.cache
def shared_memory_bytes() -> int | None:
    """Shared memory per thread block on the default device when it is a CUDA GPU, else None."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or not capability:
        return None
    major, minor = (int(x) for x in str(capability).split(".")[:2])
    return SHARED_MEMORY_KIB.get((major, minor), min(SHARED_MEMORY_KIB.values())) * 1024


def check_tuning(name: str, **values) -> None:
    """Each tuning value must be a power of two (block shapes); raises ValueError naming it."""
    for what, value in values.items():
        if not is_pow2(value):
            raise ValueError(f"{name}: {what} must be a power of two, got {value!r}")


def to_block_rows(q, kv_heads: int, block_q: int, group_p: int):
    """q [T, H, D] -> [N, K R, D]: per kv head, query blocks of Q tokens x G' heads, head-major
    inside a block (row g * Q + t), zero-padded to whole blocks and to G' heads."""
    tokens, heads, head_dim = q.shape
    group = heads // kv_heads
    padded = -(-tokens // block_q) * block_q  # T'
    q = q.reshape(tokens, kv_heads, group, head_dim)
    q = jnp.pad(q, ((0, padded - tokens), (0, 0), (0, group_p - group), (0, 0)))
    q = q.reshape(padded // block_q, block_q, kv_heads, group_p, head_dim)  # [K, Q, N, G', D]
    return q.transpose(2, 0, 3, 1, 4).reshape(kv_heads, padded * group_p, head_dim)


def from_block_rows(out, tokens: int, heads: int, block_q: int, group_p: int):
    """Inverse of `to_block_rows`: [N, K R, D] -> [T, H, D]."""
    kv_heads, _, head_dim = out.shape
    out = out.reshape(kv_heads, -1, group_p, block_q, head_dim)  # [N, K, G', Q, D]
    out = out.transpose(1, 3, 0, 2, 4).reshape(-1, kv_heads, group_p, head_dim)  # [T', N, G', D]
    return out[:tokens, :, : heads // kv_heads].reshape(tokens, heads, head_dim)


def block_sequences(query_start, num_seqs, num_blocks: int, block_q: int):
    """First and last real sequence owning rows of each query block ([K] int32 each; last < first
    when no real sequence does). Sequences with no rows fall between and cost nothing."""
    starts = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    first = jnp.searchsorted(query_start[1:], starts, side="right").astype(jnp.int32)
    last = jnp.searchsorted(query_start[:-1], starts + block_q - 1, side="right").astype(jnp.int32) - 1
    return first, jnp.minimum(last, num_seqs[0] - 1)


def pad_tables(block_tables, pages_per_block: int):
    """[S, W] -> [S, W'] with null-page entries, so a key block never reads past the table."""
    width = block_tables.shape[1]
    padded = -(-width // pages_per_block) * pages_per_block
    return jnp.pad(block_tables, ((0, 0), (0, padded - width)))


# ----------------------------------------------------------------------------------------------
# Plain-jnp reference: `ragged_reference.ragged_paged_attention_reference` (re-exported above). It
# lives in its own module because it is also the engine's attention on CPU, which needs no Pallas.
# ----------------------------------------------------------------------------------------------
