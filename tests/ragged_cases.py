"""Ragged attention test cases and a float64 oracle, shared by the reference and kernel tests.

A case is a list of sequences, each `(cached, chunk)`: `cached` tokens already in the pool and
`chunk` query rows in this step (1 = a decode row). Pages are randomly permuted, page 0 (the null
page) holds loud garbage, and `pad_tokens` / `pad_seqs` add the padding an engine step has.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

NULL_PAGE_VALUE = 50.0  # any read through a mask shows up loudly

# Named batches: decode only, prefill only, mixed; chunks on and off page edges (page size 8).
CASES = {
    "decode": [(0, 1), (7, 1), (8, 1), (15, 1), (40, 1)],
    "prefill": [(0, 5), (0, 8), (0, 17)],
    "mixed": [(9, 1), (0, 12), (16, 8), (3, 1), (5, 20)],
    "page_edges": [(8, 8), (16, 16), (7, 9), (9, 7)],
    "long_chunk": [(30, 70), (0, 1)],
}


def make_case(rng, seqs, *, dtype=jnp.float32, kv_heads=2, group=2, head_dim=32, page_size=8,
              pad_tokens=3, pad_seqs=2, width=None, extra_pages=4):
    """Returns (q, k_pages, v_pages, kv_lens, block_tables, query_start, num_seqs) as jnp arrays."""
    kv_lens = [c + n for c, n in seqs]
    used = [-(-n // page_size) for n in kv_lens]
    width = width or max(used)
    num_pages = 1 + sum(used) + extra_pages
    k = rng.standard_normal((kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    v = rng.standard_normal((kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    k[:, 0], v[:, 0] = NULL_PAGE_VALUE, NULL_PAGE_VALUE
    perm = rng.permutation(np.arange(1, num_pages))
    tables = np.zeros((len(seqs) + pad_seqs, width), np.int32)
    offset = 0
    for s, n in enumerate(used):
        tables[s, :n] = perm[offset: offset + n]
        offset += n
    rows = sum(n for _, n in seqs)
    starts = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    query_start = np.concatenate([starts, np.full(pad_seqs, rows, np.int32)])
    q = rng.standard_normal((rows + pad_tokens, kv_heads * group, head_dim)).astype(np.float32)
    lens = np.array(kv_lens + [0] * pad_seqs, np.int32)
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return (cast(q), cast(k), cast(v), jnp.asarray(lens), jnp.asarray(tables), jnp.asarray(query_start),
            jnp.asarray([len(seqs)], jnp.int32))


def oracle(q, k_pages, v_pages, kv_lens, block_tables, query_start, num_seqs, *, sm_scale=None,
           sliding_window=None, soft_cap=None):
    """Token by token in float64 numpy: the plainest reading of the contract."""
    q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
    kv_lens, tables, query_start = (np.asarray(a) for a in (kv_lens, block_tables, query_start))
    kv_heads, _, page_size, head_dim = k_pages.shape
    group = q.shape[1] // kv_heads
    scale = 1 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    out = np.zeros_like(q)
    for s in range(int(np.asarray(num_seqs)[0])):
        length, first, last = kv_lens[s], query_start[s], query_start[s + 1]
        pages = tables[s, : -(-length // page_size)]
        keys = k_pages[:, pages].reshape(kv_heads, -1, head_dim)[:, :length]  # [N, len, D]
        values = v_pages[:, pages].reshape(kv_heads, -1, head_dim)[:, :length]
        for row in range(first, last):
            pos = length - (last - first) + (row - first)
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(q.shape[1]):
                kh = keys[h // group, lo: pos + 1]
                s_ = kh @ q[row, h] * scale
                if soft_cap is not None:
                    s_ = soft_cap * np.tanh(s_ / soft_cap)
                p = np.exp(s_ - s_.max())
                out[row, h] = (p / p.sum()) @ values[h // group, lo: pos + 1]
    return out
