"""Paged decode attention: a GPU-style Pallas kernel beside its plain-jnp reference.

Where it sits in the engine: every decode step the runner calls
`backend.decode_attention` once per layer with one new query token per slot; the slot's earlier
keys and values live in the paged KV pool (`[kv_heads, num_pages, page_size, head_dim]` per layer)
and are found through the slot's row of the block table. Page 0 is the null page that padded
block-table entries point to, so every read stays in bounds.

Why this GPU lowering. Pallas has two GPU back ends. In jax 0.10.x (this machine, Python 3.11) a
bare `pl.pallas_call` lowers to Mosaic GPU by default (`jax_pallas_use_mosaic_gpu=True`), and on
the GPU box (jax 0.11.x, Python 3.12) `pl.pallas_call` for Mosaic GPU is deprecated in favour of
`plgpu.kernel`, whose warpgroup/TMA programming model only targets Hopper and newer. The
Triton-style lowering keeps the simple "one program per grid point, arrays are blocks" model, runs
down to Ampere, and is selected explicitly here by passing `pallas.triton.CompilerParams`, which
picks Triton regardless of that flag in both versions. The Triton back end is marked deprecated
(0.11.0 changelog) but still ships, so the supported range is pinned: jax >= 0.10, < 0.12. On CPU
the same kernel runs with `interpret=True`, which is how the tests check it.

Triton constraints this kernel respects: every array a program touches has power-of-two
dimensions (page_size, head_dim, the padded query-head group, pages per block), and a `dot` needs
at least 16 rows/columns, so the query-head group is padded to >= 16 rows and pages are processed
`pages_per_block` at a time so a key block has >= 16 tokens.

Dimension legend:
  S  slots (sequences in the decode batch)     H  query heads        K  kv heads
  G  query heads per kv head (H // K)          R  G padded for Triton (power of two, >= 16)
  D  head_dim                                  N  pages in the pool (page 0 = null page)
  P  page_size (tokens per page)               T  pages per sequence (block-table width)
  B  pages per compute block                   L  keys per compute block (B * P)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Finite "minus infinity": exp(_NEG - finite) underflows to 0 without inf - inf = NaN.
_NEG = -1e30
_MIN_DOT = 16  # Triton's smallest dot operand dimension.


def _dot_precision(dtype) -> lax.Precision | None:
    """float32 dots at full precision (no TF32); bf16 dots take the native path."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def online_softmax_init(rows: int, head_dim: int):
    """(acc [R, D], running max m [R], running sum l [R]) before any key block."""
    return (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _NEG, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def online_softmax_update(s, visible, v, acc, m, l, precision):
    """Folds one block of keys into the running softmax: scores s [R, L] (float32), visible
    [R or 1, L], values v [L, D]. Returns the new (acc, m, l)."""
    s = jnp.where(visible, s, _NEG)
    m_new = jnp.maximum(m, s.max(axis=1))  # [R]
    alpha = jnp.exp(m - m_new)  # [R]: rescales what was accumulated under the old max
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)  # [R, L]
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         precision=precision, preferred_element_type=jnp.float32)  # [R, D]
    return acc * alpha[:, None] + pv, m_new, l * alpha + p.sum(axis=1)


def online_softmax_result(acc, l):
    """acc / l per row; a row that saw no visible key (l == 0) gets zeros, never 0/0."""
    return jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)


# ----------------------------------------------------------------------------------------------
# Kernel (one program per (slot, kv_head))
# ----------------------------------------------------------------------------------------------


def _decode_kernel(
    lengths_ref,  # [1] int32: valid tokens of this slot
    block_table_ref,  # [T'] int32: this slot's page ids (T' = T padded to a multiple of B)
    q_ref,  # [R, D]: the query rows of the G heads sharing this kv head (zero-padded to R)
    k_ref,  # [N, P, D]: this kv head's key pages
    v_ref,  # [N, P, D]: this kv head's value pages
    o_ref,  # [R, D]: output rows
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    pages_per_block: int,
):
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    block_len = pages_per_block * page_size  # L
    length = lengths_ref[0]

    q = q_ref[...]  # [R, D]
    precision = _dot_precision(q.dtype)

    # Only the blocks that hold visible keys: [first, last] positions -> block range.
    # Clamped to the table so a too-large length cannot read past it (keys beyond are absent).
    hi = jnp.minimum((length + block_len - 1) // block_len,
                     block_table_ref.shape[0] // pages_per_block)
    if sliding_window is None:
        lo = jnp.int32(0)
    else:
        lo = jnp.maximum(length - sliding_window, 0) // block_len

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
        pos = b * block_len + jnp.arange(block_len, dtype=jnp.int32)  # [L]
        visible = pos < length
        if sliding_window is not None:
            visible = visible & (pos > length - 1 - sliding_window)
        visible = visible[None, :]  # [1, L]
        return online_softmax_update(s, visible, v, acc, m, l, precision)

    acc, _, l = lax.fori_loop(lo, hi, body, online_softmax_init(rows, head_dim))
    o_ref[...] = online_softmax_result(acc, l).astype(o_ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_call wrapper
# ----------------------------------------------------------------------------------------------


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_paged_inputs(q, k_pages, v_pages, block_tables, lengths, *, q_rank: int, name: str):
    """Shared shape/dtype validation; raises ValueError with a message naming the bad input."""
    if q.ndim != q_rank:
        raise ValueError(f"{name}: q must have rank {q_rank}, got shape {q.shape}")
    if k_pages.ndim != 4 or v_pages.ndim != 4:
        raise ValueError(
            f"{name}: k_pages/v_pages must be [kv_heads, num_pages, page_size, head_dim], "
            f"got {k_pages.shape} and {v_pages.shape}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"{name}: k_pages {k_pages.shape} != v_pages {v_pages.shape}")
    kv_heads, _, page_size, head_dim = k_pages.shape
    slots, q_heads = q.shape[0], q.shape[-2]
    if q.shape[-1] != head_dim:
        raise ValueError(f"{name}: q head_dim {q.shape[-1]} != k_pages head_dim {head_dim}")
    if q_heads % kv_heads:
        raise ValueError(f"{name}: q_heads {q_heads} is not a multiple of kv_heads {kv_heads}")
    for arr, what in ((q, "q"), (k_pages, "k_pages"), (v_pages, "v_pages")):
        if arr.dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"{name}: {what} must be float32 or bfloat16, got {arr.dtype}")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"{name}: k_pages dtype {k_pages.dtype} != v_pages {v_pages.dtype}")
    if block_tables.ndim != 2 or block_tables.shape[0] != slots:
        raise ValueError(
            f"{name}: block_tables must be [slots={slots}, pages_per_seq], got {block_tables.shape}")
    if block_tables.dtype != jnp.int32:
        raise ValueError(f"{name}: block_tables must be int32, got {block_tables.dtype}")
    if lengths.shape != (slots,) or lengths.dtype != jnp.int32:
        raise ValueError(
            f"{name}: lengths must be int32 [{slots}], got {lengths.dtype} {lengths.shape}")
    if not _is_pow2(page_size) or not _is_pow2(head_dim):
        raise ValueError(
            f"{name}: page_size ({page_size}) and head_dim ({head_dim}) must be powers of two")


def check_options(sliding_window, soft_cap, name: str):
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{name}: sliding_window must be a positive int or None, got {sliding_window!r}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"{name}: soft_cap must be positive or None, got {soft_cap!r}")


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "pages_per_block", "interpret",
                     "num_warps", "num_stages"))
def _paged_attention_jit(q, k_pages, v_pages, block_tables, lengths, *, sm_scale, sliding_window,
                         soft_cap, pages_per_block, interpret, num_warps, num_stages):
    slots, q_heads, head_dim = q.shape  # [S, H, D]
    kv_heads, num_pages, page_size, _ = k_pages.shape  # [K, N, P, D]
    group = q_heads // kv_heads
    rows = max(_MIN_DOT, _next_pow2(group))
    # [S, H, D] -> [S, K, G, D] -> [S, K, R, D] (zero rows are harmless and sliced off).
    q4 = q.reshape(slots, kv_heads, group, head_dim)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    # Pad the block table with null-page entries to a whole number of blocks.
    pages_per_seq = block_tables.shape[1]
    padded = pl.cdiv(pages_per_seq, pages_per_block) * pages_per_block
    bt = jnp.pad(block_tables, ((0, 0), (0, padded - pages_per_seq)))  # [S, T']

    kernel = functools.partial(
        _decode_kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        pages_per_block=pages_per_block)
    out = pl.pallas_call(
        kernel,
        grid=(slots, kv_heads),
        in_specs=[
            pl.BlockSpec((1,), lambda s, h: (s,)),  # lengths
            pl.BlockSpec((None, padded), lambda s, h: (s, 0)),  # block table row
            pl.BlockSpec((None, None, rows, head_dim), lambda s, h: (s, h, 0, 0)),  # q
            pl.BlockSpec((None, num_pages, page_size, head_dim), lambda s, h: (h, 0, 0, 0)),  # k
            pl.BlockSpec((None, num_pages, page_size, head_dim), lambda s, h: (h, 0, 0, 0)),  # v
        ],
        out_specs=pl.BlockSpec((None, None, rows, head_dim), lambda s, h: (s, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((slots, kv_heads, rows, head_dim), q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxserve_paged_decode",
    )(lengths, bt, q4, k_pages, v_pages)
    return out[:, :, :group, :].reshape(slots, q_heads, head_dim)


def paged_attention(
    q: jax.Array,  # [S, H, D]
    k_pages: jax.Array,  # [K, N, P, D]
    v_pages: jax.Array,  # [K, N, P, D]
    block_tables: jax.Array,  # [S, T] int32
    lengths: jax.Array,  # [S] int32
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    pages_per_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """One decode query per slot against its paged KV history (Pallas kernel).

    The query of slot s is the token at position `lengths[s] - 1`; it attends to keys at
    positions `p < lengths[s]` (and `p > lengths[s] - 1 - sliding_window` when given). Scores
    are `q.k * sm_scale` (default 1/sqrt(D)), soft-capped as `c * tanh(s / c)` when `soft_cap`
    is given. A slot with length 0 returns zeros. Accumulates in float32; returns q's dtype.
    Precondition (not checked, values are traced): 0 <= lengths[s] <= T * P.

    `pages_per_block` (a power of two; default so that a block holds >= 16 keys) sets how many
    pages one loop step loads; entries past the table are the null page and are masked.
    Raises ValueError on bad shapes, ranks, dtypes or options.
    """
    check_paged_inputs(q, k_pages, v_pages, block_tables, lengths, q_rank=3,
                       name="paged_attention")
    check_options(sliding_window, soft_cap, "paged_attention")
    page_size, head_dim = k_pages.shape[2], k_pages.shape[3]
    if pages_per_block is None:
        pages_per_block = max(1, _MIN_DOT // page_size)
    if not _is_pow2(pages_per_block):
        raise ValueError(f"paged_attention: pages_per_block must be a power of two, "
                         f"got {pages_per_block}")
    sm_scale = float(1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale)
    return _paged_attention_jit(
        q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=None if soft_cap is None else float(soft_cap),
        pages_per_block=pages_per_block, interpret=interpret, num_warps=num_warps,
        num_stages=num_stages)


# ----------------------------------------------------------------------------------------------
# Plain-jnp reference (also the CPU backend of the engine)
# ----------------------------------------------------------------------------------------------


def paged_attention_reference(
    q: jax.Array,  # [S, H, D]
    k_pages: jax.Array,  # [K, N, P, D]
    v_pages: jax.Array,  # [K, N, P, D]
    block_tables: jax.Array,  # [S, T] int32
    lengths: jax.Array,  # [S] int32
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Same contract as `paged_attention`, computed by gathering every page of every slot (XLA)."""
    slots, q_heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    width = block_tables.shape[1] * page_size
    # Batch dims (kv head, slot) lead every operand, so XLA gathers K/V once and never transposes them.
    k = k_pages[:, block_tables].reshape(kv_heads, slots, width, head_dim)  # [K, S, T*P, D]
    v = v_pages[:, block_tables].reshape(kv_heads, slots, width, head_dim)  # [K, S, T*P, D]
    qg = q.reshape(slots, kv_heads, group, head_dim).swapaxes(0, 1).astype(jnp.float32)  # [K, S, G, D]
    s = jnp.einsum("ksgd,kstd->ksgt", qg, k.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST) * scale  # [K, S, G, T*P]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    pos = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, T*P]
    last = lengths[:, None] - 1  # [S, 1]: the query position
    visible = pos <= last
    if sliding_window is not None:
        visible = visible & (pos > last - sliding_window)
    visible = visible[None, :, None, :]  # [1, S, 1, T*P]
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("ksgt,kstd->ksgd", p, v.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)  # [K, S, G, D]
    return o.swapaxes(0, 1).reshape(slots, q_heads, head_dim).astype(q.dtype)
