"""Paged decode attention, TPU-style Pallas kernel (Mosaic TPU lowering).

Same contract as `paged_attention.paged_attention` (see there and its reference
`paged_attention_reference`); `backend.decode_attention` picks this kernel when running on a TPU.

How it differs from the GPU kernel: on TPU the block tables and lengths are *scalar-prefetched*
into SMEM (`PrefetchScalarGridSpec`), so the BlockSpec index maps can read them. The grid is
(slot, kv_head, page) and the K/V BlockSpecs select one page per step through the block table,
so the Pallas TPU pipeline double-buffers the page DMAs HBM -> VMEM for us. Steps past the last
page the slot needs (or before the first one inside the sliding window) clamp their page index to
a needed page: an unchanged block index means no new DMA, and `pl.when` skips their compute. The
online-softmax state (m, l, acc) lives in VMEM scratch across the page axis, and the output block
(resident across that axis) is written on the last step.

On CPU it runs in the TPU interpreter (`interpret=True` passes `pltpu.InterpretParams()`), which
is slow (about a second per call for tiny shapes), so tests use one or two tiny shapes. A real
TPU would prefer several pages per step for long contexts (manual multi-page DMA); this version
keeps the one-page-per-step form, which is simple and correct. Pinned range: jax >= 0.10, < 0.12.

Dimension legend:
  S slots   H query heads   K kv heads   G H // K   D head_dim
  N pages in the pool (page 0 = null page)   P page_size   T pages per sequence
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxserve.pallas_kernels.paged_attention import _NEG, check_options, check_paged_inputs


def _page_range(s, lengths_ref, page_size: int, sliding_window: int | None):
    """First and last page index (in the slot's table) holding a visible key; last < first if none."""
    length = lengths_ref[s]
    last = (length + page_size - 1) // page_size - 1
    if sliding_window is None:
        first = jnp.int32(0)
    else:
        first = jnp.maximum(length - sliding_window, 0) // page_size
    return first, last


# ----------------------------------------------------------------------------------------------
# Kernel (one program per (slot, kv_head, page))
# ----------------------------------------------------------------------------------------------


def _tpu_decode_kernel(
    lengths_ref,  # SMEM [S] int32 (scalar prefetch)
    block_tables_ref,  # SMEM [S, T] int32 (scalar prefetch)
    q_ref,  # VMEM [G, D]: the G query heads of this kv head
    k_ref,  # VMEM [P, D]: one key page
    v_ref,  # VMEM [P, D]: one value page
    o_ref,  # VMEM [G, D]
    m_ref,  # VMEM scratch [G, 1] f32: running max
    l_ref,  # VMEM scratch [G, 1] f32: running denominator
    acc_ref,  # VMEM scratch [G, D] f32: running numerator
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    s, i = pl.program_id(0), pl.program_id(2)
    page_size = k_ref.shape[0]
    length = lengths_ref[s]
    first, last = _page_range(s, lengths_ref, page_size, sliding_window)

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((i >= first) & (i <= last))
    def _step():
        q = q_ref[...]  # [G, D]
        k = k_ref[...]  # [P, D]
        v = v_ref[...]  # [P, D]
        sc = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * sm_scale
        if soft_cap is not None:
            sc = soft_cap * jnp.tanh(sc / soft_cap)
        pos = i * page_size + jax.lax.broadcasted_iota(jnp.int32, sc.shape, 1)  # [G, P]
        visible = pos < length
        if sliding_window is not None:
            visible = visible & (pos > length - 1 - sliding_window)
        sc = jnp.where(visible, sc, _NEG)
        m_old = m_ref[...]  # [G, 1]
        m_new = jnp.maximum(m_old, sc.max(axis=1, keepdims=True))
        alpha = jnp.exp(m_old - m_new)
        p = jnp.where(visible, jnp.exp(sc - m_new), 0.0)  # [G, P]
        l_ref[...] = l_ref[...] * alpha + p.sum(axis=1, keepdims=True)
        m_ref[...] = m_new
        acc_ref[...] = acc_ref[...] * alpha + jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    @pl.when(i == pl.num_programs(2) - 1)
    def _finish():
        l = l_ref[...]
        out = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0)
        o_ref[...] = out.astype(o_ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_call wrapper
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret"))
def _tpu_jit(q, k_pages, v_pages, block_tables, lengths, *, sm_scale, sliding_window, soft_cap,
             interpret):
    slots, q_heads, head_dim = q.shape  # [S, H, D]
    kv_heads, _, page_size, _ = k_pages.shape  # [K, N, P, D]
    pages_per_seq = block_tables.shape[1]
    group = q_heads // kv_heads
    q4 = q.reshape(slots, kv_heads, group, head_dim)  # [S, K, G, D]

    def kv_index(s, h, i, lengths_ref, block_tables_ref):
        first, last = _page_range(s, lengths_ref, page_size, sliding_window)
        page = jnp.clip(i, first, jnp.maximum(last, first))  # stay on a needed page: no new DMA
        page = jnp.minimum(page, pages_per_seq - 1)  # never past the table
        return h, block_tables_ref[s, page], 0, 0

    qo_spec = pl.BlockSpec((None, None, group, head_dim), lambda s, h, i, *_: (s, h, 0, 0))
    kv_spec = pl.BlockSpec((None, None, page_size, head_dim), kv_index)
    kernel = functools.partial(_tpu_decode_kernel, sm_scale=sm_scale,
                               sliding_window=sliding_window, soft_cap=soft_cap)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(slots, kv_heads, pages_per_seq),
            in_specs=[qo_spec, kv_spec, kv_spec],
            out_specs=qo_spec,
            scratch_shapes=[
                pltpu.VMEM((group, 1), jnp.float32),
                pltpu.VMEM((group, 1), jnp.float32),
                pltpu.VMEM((group, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((slots, kv_heads, group, head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="jaxserve_paged_decode_tpu",
    )(lengths, block_tables, q4, k_pages, v_pages)
    return out.reshape(slots, q_heads, head_dim)


def paged_attention_tpu(
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
) -> jax.Array:
    """TPU-style paged decode attention; same contract and ValueErrors as `paged_attention`."""
    check_paged_inputs(q, k_pages, v_pages, block_tables, lengths, q_rank=3,
                       name="paged_attention_tpu")
    check_options(sliding_window, soft_cap, "paged_attention_tpu")
    head_dim = k_pages.shape[3]
    sm_scale = float(1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale)
    return _tpu_jit(q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale,
                    sliding_window=sliding_window,
                    soft_cap=None if soft_cap is None else float(soft_cap), interpret=interpret)
