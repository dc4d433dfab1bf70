"""The jnp ragged paged attention (the kernels' reference and the CPU backend) against a float64
oracle: decode only, prefill only, mixed, chunks on and off page edges, a sliding window that
crosses a chunk edge, soft cap, GQA, float32 and bfloat16, padding sequences and tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels.ragged_reference import ragged_paged_attention_reference
from ragged_cases import CASES, make_case, oracle

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def check(args, dtype, blocks=None, **options):
    """`blocks`: the reference's block sizes (the oracle has none)."""
    out = jax.jit(lambda *a: ragged_paged_attention_reference(*a, **options, **(blocks or {})))(*args)
    assert out.dtype == jnp.dtype(dtype)
    expected = oracle(*args, **options)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=TOL[dtype], rtol=TOL[dtype])
    return out


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cases_match_the_float64_oracle(name, dtype):
    args = make_case(np.random.default_rng(len(name)), CASES[name], dtype=dtype)
    check(args, dtype)


@pytest.mark.parametrize("group,page_size", [(1, 8), (4, 16), (8, 4)])
def test_gqa_ratios_and_page_sizes(group, page_size):
    seqs = [(page_size - 1, 1), (0, 2 * page_size + 3), (page_size, page_size), (2 * page_size + 1, 1)]
    args = make_case(np.random.default_rng(group), seqs, group=group, page_size=page_size)
    check(args, jnp.float32)


@pytest.mark.parametrize("window", [1, 5, 8, 13])
def test_sliding_window_crossing_chunk_and_page_edges(window):
    # Chunks start at 6 and 16 with windows reaching back across the chunk edge and page edges.
    seqs = [(6, 10), (16, 5), (20, 1), (0, 9)]
    args = make_case(np.random.default_rng(window), seqs)
    check(args, jnp.float32, sliding_window=window)


def test_soft_cap_and_scale():
    args = make_case(np.random.default_rng(7), CASES["mixed"])
    check(args, jnp.float32, soft_cap=5.0, sm_scale=0.3)


def test_padding_rows_are_zero_and_null_page_never_leaks():
    args = make_case(np.random.default_rng(3), CASES["mixed"], pad_tokens=5, pad_seqs=3)
    out = check(args, jnp.float32)
    real_rows = int(args[5][len(CASES["mixed"])])
    assert np.all(np.asarray(out)[real_rows:] == 0)
    assert np.abs(np.asarray(out)).max() < 10  # the null page holds 50s


def test_small_blocks_give_the_same_result():
    args = make_case(np.random.default_rng(4), CASES["long_chunk"] + CASES["decode"])
    big = ragged_paged_attention_reference(*args)
    small = ragged_paged_attention_reference(*args, keys_per_block=8, rows_per_block=4)
    np.testing.assert_allclose(np.asarray(big), np.asarray(small), atol=2e-6)


@pytest.mark.parametrize("window", [None, 5, 13])
def test_chunks_split_into_wide_and_short_row_blocks(window):
    # Wide blocks of 16 rows while at least 8 are left, then blocks of 4: 70 rows are 4 wide blocks
    # and 2 short ones, 20 are 1 and 1, 12 and 9 are one part-empty wide block, 5 are short only.
    seqs = [(30, 70), (3, 20), (16, 12), (0, 9), (7, 5), (40, 1)]
    args = make_case(np.random.default_rng(11), seqs)
    check(args, jnp.float32, dict(keys_per_block=8, rows_per_block=4, wide_block=(16, 16)), sliding_window=window)


def test_default_wide_blocks_on_a_long_chunk():
    # A 300-row chunk behind 200 cached tokens: one wide block of 256 rows, then 44 rows in short ones.
    args = make_case(np.random.default_rng(12), [(200, 300), (9, 1)], kv_heads=1, group=2, head_dim=16,
                     page_size=16)
    check(args, jnp.float32)
    check(args, jnp.float32, sliding_window=64)


def test_bad_inputs_raise_value_error():
    q, k, v, lens, tables, starts, n = make_case(np.random.default_rng(0), CASES["decode"])
    with pytest.raises(ValueError, match="query_start"):
        ragged_paged_attention_reference(q, k, v, lens, tables, starts[:-1], n)
    with pytest.raises(ValueError, match="kv heads"):
        ragged_paged_attention_reference(q[:, :3], k, v, lens, tables, starts, n)
    with pytest.raises(ValueError, match="sliding_window"):
        ragged_paged_attention_reference(q, k, v, lens, tables, starts, n, sliding_window=0)
    with pytest.raises(ValueError, match="block_tables"):
        ragged_paged_attention_reference(q, k, v, lens, tables[:2], starts, n)
