"""Attention against the paged KV pool: the K/V write, decode dispatch, and in-prompt prefill.

Pool layout per layer: k, v `[N, M, S, K]`; page 0 is the null page that padding reads and writes.
Legend: B batch, T tokens, H query heads, N kv heads, G = H/N, K head dim, M pool pages,
S page size, P pages per sequence (block-table width).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels import backend as pallas_backend

NEG_INF = -1e30


def write_kv(kv, key, value, positions, block_tables, lengths):
    """Scatters this step's K/V into the pool.

    key, value: [B, T, N, K]; positions: [B, T]; block_tables: [B, P]; lengths: [B].
    Tokens at or past their sequence's length (padding) go to the null page.
    """
    k_pool, v_pool = kv
    page_size = k_pool.shape[2]
    b, t, n, k = key.shape
    valid = (positions >= 0) & (positions < lengths[:, None])  # [B, T]; free slots have length 0
    page_index = jnp.clip(positions // page_size, 0, block_tables.shape[1] - 1)
    pages = jnp.where(valid, jnp.take_along_axis(block_tables, page_index, axis=1), 0).reshape(-1)
    offsets = (positions % page_size).reshape(-1)
    k_new = key.reshape(b * t, n, k).transpose(1, 0, 2).astype(k_pool.dtype)  # [N, B T, K]
    v_new = value.reshape(b * t, n, k).transpose(1, 0, 2).astype(v_pool.dtype)
    return k_pool.at[:, pages, offsets].set(k_new), v_pool.at[:, pages, offsets].set(v_new)


def _masked_softmax(scores, visible, soft_cap):
    """scores: [..., keys] in float32; visible: bool mask broadcastable to scores."""
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    return jax.nn.softmax(jnp.where(visible, scores, NEG_INF), axis=-1)


def decode_attention(q, k_pool, v_pool, block_tables, lengths, *, backend, scale, window=None, soft_cap=None):
    """One query per sequence against its pages, through the configured backend: "reference"
    (XLA gather) or "pallas" (the kernels, in interpret mode on CPU).

    q: [B, H, K]; block_tables: [B, P]; lengths: [B] (the query sits at position length - 1).
    Returns [B, H, K]; a sequence of length 0 gets zeros.
    """
    return pallas_backend.decode_attention(q, k_pool, v_pool, block_tables, lengths, backend=backend,
                                           sm_scale=scale, sliding_window=window, soft_cap=soft_cap,
                                           interpret=jax.default_backend() == "cpu")


def prefill_attention(q, key, value, lengths, *, scale, window=None, soft_cap=None):
    """Causal attention within prompts that start at position 0.

    q: [B, T, H, K]; key, value: [B, T, N, K]; lengths: [B] real tokens per prompt.
    Returns [B, T, H, K].
    """
    b, t, h, k = q.shape
    n = key.shape[2]
    qg = q.reshape(b, t, n, h // n, k).astype(jnp.float32) * scale
    scores = jnp.einsum("bqngk,btnk->bngqt", qg, key.astype(jnp.float32))  # [B, N, G, T, T]
    qpos = jnp.arange(t)[:, None]
    kpos = jnp.arange(t)[None, :]
    visible = (kpos <= qpos)[None] & (kpos[None] < lengths[:, None, None])  # [B, T, T]
    if window is not None:
        visible &= (kpos > qpos - window)[None]
    probs = _masked_softmax(scores, visible[:, None, None], soft_cap)
    out = jnp.einsum("bngqt,btnk->bqngk", probs, value.astype(jnp.float32))
    return out.reshape(b, t, h, k).astype(q.dtype)
