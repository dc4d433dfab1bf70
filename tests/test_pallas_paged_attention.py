"""Paged decode attention: Pallas kernels (interpret mode on CPU) against the plain-jnp reference.

The sweep covers dtype x page size x head_dim x GQA ratio with a pairwise (orthogonal-array)
subset instead of the full product; every call batches the lengths {1, P-1, P, P+1, max} (and 0)
into different slots, with randomly permuted block tables padded by the null page 0.
Tolerances: float32 atol/rtol 2e-5; bfloat16 atol/rtol 2e-2 (the kernel feeds bf16 probabilities
to the P.V dot and rounds the output to bf16; the reference works in float32 throughout).
"""

from __future__ import annotations

import importlib
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import backend
from jaxserve.pallas_kernels.paged_attention import paged_attention, paged_attention_reference

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
NULL_PAGE_VALUE = 50.0  # garbage in page 0: any leak through the mask shows up loudly


def make_case(rng, *, dtype, kv_heads, group, page_size, head_dim, lengths, pages_per_seq,
              extra_pages=3):
    """Random pool + queries; slot s owns cdiv(lengths[s], P) pages, the rest of its row is 0."""
    lengths = np.asarray(lengths, np.int32)
    slots = len(lengths)
    used = [-(-int(n) // page_size) for n in lengths]
    num_pages = 1 + sum(used) + extra_pages
    k = rng.standard_normal((kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    v = rng.standard_normal((kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    k[:, 0], v[:, 0] = NULL_PAGE_VALUE, NULL_PAGE_VALUE
    perm = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((slots, pages_per_seq), np.int32)
    offset = 0
    for s, n in enumerate(used):
        table[s, :n] = perm[offset:offset + n]
        offset += n
    q = rng.standard_normal((slots, kv_heads * group, head_dim)).astype(np.float32)
    as_dtype = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return (as_dtype(q), as_dtype(k), as_dtype(v), jnp.asarray(table), jnp.asarray(lengths))


def edge_lengths(page_size, pages_per_seq):
    return [0, 1, page_size - 1, page_size, page_size + 1, page_size * pages_per_seq]


def assert_close(out, ref, dtype):
    assert out.dtype == ref.dtype == jnp.dtype(dtype)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=tol, rtol=tol)


# Orthogonal array L9(3^4): every pair of values of (page_size, head_dim, group) appears once;
# the 4th column picks the dtype so that each value of each axis meets both dtypes.
_L9 = [(0, 0, 0, 0), (0, 1, 1, 2), (0, 2, 2, 1), (1, 0, 1, 1), (1, 1, 2, 0), (1, 2, 0, 2),
       (2, 0, 2, 2), (2, 1, 0, 1), (2, 2, 1, 0)]
_PAGE, _DIM, _GROUP = (8, 16, 32), (64, 128, 256), (1, 4, 8)
_DTYPE = (jnp.float32, jnp.bfloat16, jnp.bfloat16)
SWEEP = [(_DTYPE[d], _PAGE[p], _DIM[h], _GROUP[g]) for p, h, g, d in _L9]


@pytest.mark.parametrize("dtype,page_size,head_dim,group", SWEEP,
                         ids=[f"{jnp.dtype(d).name}-P{p}-D{h}-G{g}" for d, p, h, g in SWEEP])
def test_sweep_matches_reference(dtype, page_size, head_dim, group):
    rng = np.random.default_rng(page_size * 1000 + head_dim + group)
    pages_per_seq = 3
    args = make_case(rng, dtype=dtype, kv_heads=2, group=group, page_size=page_size,
                     head_dim=head_dim, lengths=edge_lengths(page_size, pages_per_seq),
                     pages_per_seq=pages_per_seq)
    out = paged_attention(*args, interpret=True)
    ref = paged_attention_reference(*args)
    assert_close(out, ref, dtype)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)  # length 0 -> zeros


@pytest.mark.parametrize("window", [1, 5, 16, 100])
def test_sliding_window(window):
    rng = np.random.default_rng(window)
    args = make_case(rng, dtype=jnp.float32, kv_heads=1, group=4, page_size=8, head_dim=64,
                     lengths=[0, 1, 7, 9, 20, 32], pages_per_seq=4)
    out = paged_attention(*args, sliding_window=window, interpret=True)
    ref = paged_attention_reference(*args, sliding_window=window)
    assert_close(out, ref, jnp.float32)
    if window == 1:  # the query sees only its own key: output is that token's value row
        q, k, v, table, lengths = args
        pos = 19  # slot 4, length 20
        page = table[4, pos // 8]
        np.testing.assert_allclose(out[4], jnp.broadcast_to(v[0, page, pos % 8], (4, 64)),
                                   atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_soft_cap_and_scale(dtype):
    rng = np.random.default_rng(7)
    args = make_case(rng, dtype=dtype, kv_heads=2, group=2, page_size=16, head_dim=64,
                     lengths=[3, 16, 40], pages_per_seq=3)
    kw = dict(soft_cap=5.0, sm_scale=0.5, sliding_window=20)
    out = paged_attention(*args, interpret=True, **kw)
    ref = paged_attention_reference(*args, **kw)
    assert_close(out, ref, dtype)
    # The cap really matters at this scale: without it the result differs.
    nocap = paged_attention_reference(*args, sm_scale=0.5, sliding_window=20)
    assert float(jnp.abs(nocap.astype(jnp.float32) - ref.astype(jnp.float32)).max()) > 1e-2


def test_length_zero_slots_are_zero_and_pages_per_block():
    rng = np.random.default_rng(3)
    args = make_case(rng, dtype=jnp.float32, kv_heads=2, group=4, page_size=8, head_dim=64,
                     lengths=[0, 0, 13], pages_per_seq=5)
    out = paged_attention(*args, interpret=True, pages_per_block=4)
    np.testing.assert_array_equal(np.asarray(out[:2]), 0.0)
    assert_close(out, paged_attention_reference(*args), jnp.float32)


def _bad_inputs():
    f32 = jnp.float32
    q, k, v, bt, ln = (jnp.zeros((2, 4, 64), f32), jnp.zeros((2, 5, 8, 64), f32),
                       jnp.zeros((2, 5, 8, 64), f32), jnp.zeros((2, 3), jnp.int32),
                       jnp.zeros((2,), jnp.int32))
    return {
        "q rank": (q[0], k, v, bt, ln, {}),
        "kv rank": (q, k[0], v[0], bt, ln, {}),
        "k != v": (q, k, v[:, :4], bt, ln, {}),
        "head_dim": (q[..., :32], k, v, bt, ln, {}),
        "heads not multiple": (jnp.zeros((2, 3, 64), f32), k, v, bt, ln, {}),
        "q int": (q.astype(jnp.int32), k, v, bt, ln, {}),
        "float16": (q.astype(jnp.float16), k.astype(jnp.float16), v.astype(jnp.float16), bt, ln,
                    {}),
        "k/v dtypes": (q, k, v.astype(jnp.bfloat16), bt, ln, {}),
        "table dtype": (q, k, v, bt.astype(jnp.float32), ln, {}),
        "table slots": (q, k, v, bt[:1], ln, {}),
        "table rank": (q, k, v, bt[0], ln, {}),
        "lengths dtype": (q, k, v, bt, ln.astype(jnp.int64 if jax.config.x64_enabled
                                                  else jnp.int16), {}),
        "lengths shape": (q, k, v, bt, ln[:1], {}),
        "page_size not pow2": (q, k[:, :, :6], v[:, :, :6], bt, ln, {}),
        "window": (q, k, v, bt, ln, {"sliding_window": 0}),
        "soft_cap": (q, k, v, bt, ln, {"soft_cap": -1.0}),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_input_raises_value_error(case):
    q, k, v, bt, ln, kw = _bad_inputs()[case]
    with pytest.raises(ValueError):
        paged_attention(q, k, v, bt, ln, interpret=True, **kw)


def test_backend_selection_and_dispatch():
    assert backend.select_backend("reference") == "reference"
    assert backend.select_backend("pallas") == "pallas"
    expected = "reference" if jax.default_backend() == "cpu" else "pallas"
    assert backend.select_backend("auto") == expected
    with pytest.raises(ValueError):
        backend.select_backend("triton")
    rng = np.random.default_rng(11)
    args = make_case(rng, dtype=jnp.float32, kv_heads=2, group=2, page_size=8, head_dim=64,
                     lengths=[0, 5, 17], pages_per_seq=3)
    kw = dict(sm_scale=None, sliding_window=6, soft_cap=30.0)

    @jax.jit
    def both(*a):  # the engine calls it inside jit with static options
        return (backend.decode_attention(*a, backend="pallas", interpret=True, **kw),
                backend.decode_attention(*a, backend="reference", interpret=False, **kw))

    pallas_out, ref_out = both(*args)
    assert_close(pallas_out, ref_out, jnp.float32)
    with pytest.raises(ValueError):
        backend.decode_attention(*args, backend="nope", **kw)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_triton_ir(dtype):
    """The GPU kernel must satisfy Triton's static rules (power-of-two blocks, dot sizes).

    Lowering for 'cuda' works from a CPU-only jaxlib and checks them without a GPU.
    """
    # importlib: the package re-exports a function of the same name as this module.
    pa = importlib.import_module("jaxserve.pallas_kernels.paged_attention")

    shapes = (jax.ShapeDtypeStruct((3, 8, 64), dtype), jax.ShapeDtypeStruct((2, 9, 8, 64), dtype),
              jax.ShapeDtypeStruct((2, 9, 8, 64), dtype), jax.ShapeDtypeStruct((3, 5), jnp.int32),
              jax.ShapeDtypeStruct((3,), jnp.int32))
    fn = lambda *a: pa._paged_attention_jit(  # noqa: E731
        *a, sm_scale=0.125, sliding_window=7, soft_cap=20.0, pages_per_block=2, interpret=False,
        num_warps=4, num_stages=2)
    try:
        text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    except (RuntimeError, NotImplementedError) as e:  # pragma: no cover - jaxlib without cuda
        pytest.skip(f"cannot lower for cuda here: {e}")
    assert "triton" in text


def test_tpu_kernel_interpret():
    """TPU-style kernel (scalar-prefetched block tables) in the TPU interpreter: 2 tiny shapes."""
    from jaxserve.pallas_kernels.tpu_paged_attention import paged_attention_tpu

    rng = np.random.default_rng(5)
    for dtype, kw in ((jnp.float32, {}), (jnp.bfloat16, dict(sliding_window=5, soft_cap=10.0))):
        args = make_case(rng, dtype=dtype, kv_heads=1, group=2, page_size=8, head_dim=128,
                         lengths=[0, 1, 17], pages_per_seq=3)
        out = paged_attention_tpu(*args, interpret=True, **kw)
        assert_close(out, paged_attention_reference(*args, **kw), dtype)
        np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)


def test_matches_jax_shipped_gpu_kernel():
    """Same answer as jax.experimental.pallas.ops.gpu.paged_attention (interpret mode).

    Same K/V layout [K, N, P, D]; it applies no 1/sqrt(D) scale (so sm_scale=1 here), needs
    pages_per_seq divisible by k_splits * pages_per_compute_block, and its length-0 behaviour is
    not specified, so every slot here has length >= 1.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu import paged_attention as shipped
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"jax's shipped GPU paged_attention is not importable here: {e}")
    rng = np.random.default_rng(13)
    args = make_case(rng, dtype=jnp.float32, kv_heads=2, group=8, page_size=16, head_dim=64,
                     lengths=[1, 15, 16, 17, 64], pages_per_seq=4)
    q = args[0] / math.sqrt(64)  # keep logits moderate with sm_scale=1
    args = (q, *args[1:])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = shipped.paged_attention(*args, block_h=16, pages_per_compute_block=2,
                                             k_splits=2, interpret=True)
    except Exception as e:  # pragma: no cover - depends on the installed jax
        pytest.skip(f"shipped kernel cannot run in interpret mode here: {type(e).__name__}: {e}")
    ours = paged_attention(*args, sm_scale=1.0, interpret=True)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(paged_attention_reference(
        *args, sm_scale=1.0)), atol=2e-5, rtol=2e-5)
