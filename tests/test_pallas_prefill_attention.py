"""Chunked-prefill attention over the paged pool: Pallas kernel (interpret mode) vs reference.

Each call batches slots with different (start, chunk_len): a whole prompt (start 0), a chunk
after a partly filled page, a chunk that ends exactly on a page boundary, an empty slot and
padded query rows. Pairwise sweep of dtype x page size x head_dim x GQA ratio.
Tolerances: float32 atol/rtol 2e-5; bfloat16 atol/rtol 2e-2.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels.paged_attention import paged_attention_reference
from jaxserve.pallas_kernels.prefill_attention import (
    prefill_attention, prefill_attention_reference)

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def make_case(rng, *, dtype, kv_heads, group, page_size, head_dim, chunk, starts, chunk_lens,
              pages_per_seq):
    """Random pool holding tokens [0, start + chunk_len) of each slot; null page 0 is garbage."""
    starts, chunk_lens = np.asarray(starts, np.int32), np.asarray(chunk_lens, np.int32)
    slots = len(starts)
    used = [-(-int(a + b) // page_size) for a, b in zip(starts, chunk_lens)]
    assert max(used) <= pages_per_seq
    num_pages = 1 + sum(used) + 2
    k = rng.standard_normal((kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    v = rng.standard_normal((kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    k[:, 0], v[:, 0] = 50.0, 50.0
    perm = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((slots, pages_per_seq), np.int32)
    offset = 0
    for s, n in enumerate(used):
        table[s, :n] = perm[offset:offset + n]
        offset += n
    q = rng.standard_normal((slots, chunk, kv_heads * group, head_dim)).astype(np.float32)
    to = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return (to(q), to(k), to(v), jnp.asarray(table), jnp.asarray(starts),
            jnp.asarray(chunk_lens))


def assert_close(out, ref, dtype, chunk_lens):
    assert out.dtype == ref.dtype == jnp.dtype(dtype)
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert not np.isnan(out32).any()
    tol = TOL[dtype]
    np.testing.assert_allclose(out32, ref32, atol=tol, rtol=tol)
    for s, n in enumerate(np.asarray(chunk_lens)):  # padded query rows are exactly zero
        np.testing.assert_array_equal(out32[s, n:], 0.0)


def batch_for(page_size, chunk):
    """(starts, chunk_lens): whole prompt, mid-page start, page-boundary end, empty, padded."""
    p = page_size
    return [0, p - 1, 2 * p - chunk, 5, 2 * p + 1], [chunk, chunk - 3, chunk, 0, 1]


_L9 = [(0, 0, 0, 0), (0, 1, 1, 2), (0, 2, 2, 1), (1, 0, 1, 1), (1, 1, 2, 0), (1, 2, 0, 2),
       (2, 0, 2, 2), (2, 1, 0, 1), (2, 2, 1, 0)]
_PAGE, _DIM, _GROUP = (8, 16, 32), (64, 128, 256), (1, 4, 8)
_DTYPE = (jnp.float32, jnp.bfloat16, jnp.bfloat16)
SWEEP = [(_DTYPE[d], _PAGE[p], _DIM[h], _GROUP[g]) for p, h, g, d in _L9]


@pytest.mark.parametrize("dtype,page_size,head_dim,group", SWEEP,
                         ids=[f"{jnp.dtype(d).name}-P{p}-D{h}-G{g}" for d, p, h, g in SWEEP])
def test_sweep_matches_reference(dtype, page_size, head_dim, group):
    rng = np.random.default_rng(page_size * 1000 + head_dim + group)
    chunk = 8
    starts, lens = batch_for(page_size, chunk)
    args = make_case(rng, dtype=dtype, kv_heads=2, group=group, page_size=page_size,
                     head_dim=head_dim, chunk=chunk, starts=starts, chunk_lens=lens,
                     pages_per_seq=3)
    out = prefill_attention(*args, interpret=True)
    assert_close(out, prefill_attention_reference(*args), dtype, lens)


@pytest.mark.parametrize("window,soft_cap,block_q", [(1, None, 4), (6, 8.0, 8), (19, None, 16),
                                                     (None, 3.0, 2)])
def test_window_soft_cap_and_query_blocks(window, soft_cap, block_q):
    rng = np.random.default_rng(17)
    starts, lens = [0, 3, 13, 0], [12, 12, 7, 0]
    args = make_case(rng, dtype=jnp.float32, kv_heads=2, group=3, page_size=8, head_dim=64,
                     chunk=12, starts=starts, chunk_lens=lens, pages_per_seq=4)
    kw = dict(sliding_window=window, soft_cap=soft_cap, sm_scale=0.3)
    out = prefill_attention(*args, interpret=True, block_q=block_q, **kw)
    assert_close(out, prefill_attention_reference(*args, **kw), jnp.float32, lens)


def test_chunked_equals_whole_prompt():
    """Prefill of 20 tokens in one call == chunks of 8 + 8 + 4 (same pool, same pages)."""
    rng = np.random.default_rng(23)
    q, k, v, table, _, _ = make_case(rng, dtype=jnp.float32, kv_heads=1, group=4, page_size=8,
                                     head_dim=64, chunk=24, starts=[0], chunk_lens=[20],
                                     pages_per_seq=3)
    whole = prefill_attention(q, k, v, table, jnp.array([0], jnp.int32),
                              jnp.array([20], jnp.int32), interpret=True, sliding_window=10)
    parts = []
    for start, n in ((0, 8), (8, 8), (16, 4)):
        qc = q[:, start:start + 8]
        if qc.shape[1] < 8:
            qc = jnp.pad(qc, ((0, 0), (0, 8 - qc.shape[1]), (0, 0), (0, 0)))
        out = prefill_attention(qc, k, v, table, jnp.array([start], jnp.int32),
                                jnp.array([n], jnp.int32), interpret=True, sliding_window=10)
        parts.append(out[:, :n])
    np.testing.assert_allclose(np.asarray(jnp.concatenate(parts, axis=1)),
                               np.asarray(whole[:, :20]), atol=2e-5, rtol=2e-5)


def test_single_token_chunk_equals_decode():
    rng = np.random.default_rng(29)
    lengths = np.array([1, 9, 16, 30], np.int32)
    q, k, v, table, starts, lens = make_case(
        rng, dtype=jnp.float32, kv_heads=2, group=4, page_size=8, head_dim=64, chunk=1,
        starts=lengths - 1, chunk_lens=[1, 1, 1, 1], pages_per_seq=4)
    out = prefill_attention(q, k, v, table, starts, lens, interpret=True, soft_cap=20.0)
    dec = paged_attention_reference(q[:, 0], k, v, table, jnp.asarray(lengths), soft_cap=20.0)
    np.testing.assert_allclose(np.asarray(out[:, 0]), np.asarray(dec), atol=2e-5, rtol=2e-5)


def test_bad_input_raises_value_error():
    f32 = jnp.float32
    q, k = jnp.zeros((2, 4, 4, 64), f32), jnp.zeros((2, 5, 8, 64), f32)
    bt, st, ln = jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.ones((2,), jnp.int32)
    cases = [
        (q[0], k, k, bt, st, ln, {}),  # q rank 3
        (q, k, k, bt, st.astype(f32), ln, {}),  # starts dtype
        (q, k, k, bt, st[:1], ln, {}),  # starts shape
        (q, k, k, bt, st, ln[:1], {}),  # chunk_lens shape
        (q.astype(jnp.int32), k, k, bt, st, ln, {}),  # q dtype
        (q, k, k, bt, st, ln, {"block_q": 3}),  # block_q not a power of two
        (q, k, k, bt, st, ln, {"sliding_window": -2}),
    ]
    for q_, k_, v_, bt_, st_, ln_, kw in cases:
        with pytest.raises(ValueError):
            prefill_attention(q_, k_, v_, bt_, st_, ln_, interpret=True, **kw)


def test_lowers_to_triton_ir():
    pa = importlib.import_module("jaxserve.pallas_kernels.prefill_attention")
    shapes = (jax.ShapeDtypeStruct((2, 12, 6, 64), jnp.bfloat16),
              jax.ShapeDtypeStruct((2, 9, 8, 64), jnp.bfloat16),
              jax.ShapeDtypeStruct((2, 9, 8, 64), jnp.bfloat16),
              jax.ShapeDtypeStruct((2, 5), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32),
              jax.ShapeDtypeStruct((2,), jnp.int32))
    fn = lambda *a: pa._prefill_attention_jit(  # noqa: E731
        *a, sm_scale=0.125, sliding_window=7, soft_cap=20.0, pages_per_block=2, block_q=4,
        interpret=False, num_warps=4, num_stages=2)
    try:
        text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    except (RuntimeError, NotImplementedError) as e:  # pragma: no cover - jaxlib without cuda
        pytest.skip(f"cannot lower for cuda here: {e}")
    assert "triton" in text
