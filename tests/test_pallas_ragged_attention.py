"""Ragged paged attention kernels, GPU-style (Triton) and TPU-style (Mosaic), against the jnp
reference and the float64 oracle, in interpret mode on CPU; plus lowering for their real targets.

Every case runs on both kernels: decode only, prefill only, mixed batches, chunks on and off page
edges, sliding windows that cross a chunk edge, soft cap, GQA ratios (1, 3, 4, 6, 8), float32,
bfloat16 and float32 queries over a bfloat16 pool, padding sequences of length 0 and padding
tokens, a real sequence with no rows this step, and a pairwise sweep of page size x head_dim x
GQA. Block sizes are set small in most cases so query blocks span several sequences and sequences
span several blocks. The TPU interpreter fills fresh VMEM with NaN, so a stale buffer read shows.
On a GPU, the GPU kernel's cases run compiled instead of interpreted.
Lowering: `jax.export` for CUDA (a Triton call) and for TPU v5e and v6e (a Mosaic call, the chip
pinned); with libtpu installed, a deviceless compile runs Mosaic itself.
Tolerances: float32 2e-5; bfloat16 2e-2 (bf16 probabilities into the P.V dot, bf16 output).
The TPU interpreter is slow (seconds per call), so its shapes stay small.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxserve.pallas_kernels.ragged_paged_attention import default_pages_per_block, ragged_paged_attention
from jaxserve.pallas_kernels import ragged_reference
from jaxserve.pallas_kernels.ragged_reference import ragged_paged_attention_reference
from jaxserve.pallas_kernels.tpu_ragged_paged_attention import ragged_paged_attention_tpu
from ragged_cases import CASES, NULL_PAGE_VALUE, make_case, oracle

TOL = {"float32": 2e-5, "bfloat16": 2e-2}
KERNELS = {"gpu": ragged_paged_attention, "tpu": ragged_paged_attention_tpu}
# One shape bucket (tokens, sequences, block-table width, pool pages) for most cases, as the engine
# pads its steps: each kernel then compiles once per dtype and options, not once per case.
TOKENS, SEQS, WIDTH, PAGES = 96, 32, 16, 80
_reference = jax.jit(ragged_paged_attention_reference,
                     static_argnames=("sm_scale", "sliding_window", "soft_cap"))


@pytest.fixture(autouse=True, scope="module")
def _quick_compiles():
    """Interpret mode compiles every kernel body with XLA:CPU; most optimizations only cost time
    here (about a third of each compile), so they are off for this module."""
    saved = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", saved)


def interpret(kernel) -> bool:
    """Interpret mode unless the kernel's own accelerator is here: on a GPU machine the same tests
    run the Triton kernel for real (the TPU kernel stays interpreted there)."""
    return jax.default_backend() != kernel


def bucketed(seed, seqs, page_size=8, **kw):
    """`make_case` padded to the bucket: padding tokens, zero-length sequences, spare pages."""
    rows = sum(n for _, n in seqs)
    used = sum(-(-(c + n) // page_size) for c, n in seqs)
    return make_case(np.random.default_rng(seed), seqs, page_size=page_size,
                     pad_tokens=TOKENS - rows, pad_seqs=SEQS - len(seqs), width=WIDTH,
                     extra_pages=PAGES - 1 - used, **kw)


def small(kernel, args, pages_per_block=2):
    """Small blocks, so query blocks span sequences and sequences span blocks: 8 tokens on GPU (at
    least the 16 rows a Triton dot needs), 16 on TPU (fewer programs: its interpreter is slow)."""
    group = args[0].shape[1] // args[1].shape[0]
    block_q = 16 if kernel == "tpu" else max(8, 16 // (1 << (group - 1).bit_length()))
    return dict(block_q=block_q, pages_per_block=pages_per_block)


def run(kernel, args, tuning=None, reference=True, **options):
    """The kernel in interpret mode (small blocks unless `tuning` is given); checks it against
    the float64 oracle and (unless `reference=False`) the jnp reference; returns it as float64."""
    dtype = args[0].dtype
    tuning = small(kernel, args) if tuning is None else tuning
    out = KERNELS[kernel](*args, interpret=interpret(kernel), **tuning, **options)
    assert out.dtype == dtype and out.shape == args[0].shape
    got = np.asarray(out, np.float64)
    assert np.isfinite(got).all()
    tol = TOL[jnp.dtype(dtype).name]
    if reference:
        ref = np.asarray(_reference(*args, **options), np.float64)
        np.testing.assert_allclose(got, ref, atol=tol, rtol=tol)
    np.testing.assert_allclose(got, oracle(*args, **options), atol=tol, rtol=tol)
    return got


def real_rows(args):
    return int(np.asarray(args[5])[int(args[6][0])])


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_named_batches(kernel, dtype):
    """Decode only, prefill only, mixed, chunks on page edges, a long chunk; one bucket, so one
    compile; padding rows come back zero and the null page never leaks."""
    for name in sorted(CASES):
        args = bucketed(len(name), CASES[name], dtype=dtype)
        out = run(kernel, args)
        assert np.all(out[real_rows(args):] == 0), name
        assert np.abs(out).max() < NULL_PAGE_VALUE / 5, name


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("q_dtype,kv_dtype", [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)],
                         ids=["q-f32-kv-bf16", "q-bf16-kv-f32"])
def test_query_and_pool_dtypes_differ(kernel, q_dtype, kv_dtype):
    """The engine's default is float32 activations over a bfloat16 pool: the kernels take q in
    the pool's dtype for their dots and answer in q's dtype."""
    q, k, v, *meta = bucketed(17, CASES["mixed"] + CASES["decode"][:2])
    args = (q.astype(q_dtype), k.astype(kv_dtype), v.astype(kv_dtype), *meta)
    out = KERNELS[kernel](*args, interpret=interpret(kernel), sliding_window=7, **small(kernel, args))
    assert out.dtype == q_dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), oracle(*args, sliding_window=7),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("window", [1, 5, 13])
def test_sliding_window_crossing_chunk_and_page_edges(kernel, window):
    # Chunks start at 6 and 16, windows reach back across the chunk edge and page edges.
    seqs = [(6, 10), (16, 5), (20, 1), (0, 9)]
    run(kernel, bucketed(window, seqs), sliding_window=window)


@pytest.mark.parametrize("kernel", sorted(KERNELS) + ["reference"])
def test_a_layer_of_the_stacked_pool_with_a_traced_window(kernel):
    """The engine's call: the whole stacked pool [N, layers, M, P, D], the layer and the window as
    traced int32 scalars (one scan body serves local and global layers). Each layer's answer
    equals the oracle's on that layer's own pool, windowed or not."""
    args = bucketed(11, [(6, 10), (16, 5), (20, 1), (0, 9)])
    q, k, v, *meta = args
    rng = np.random.default_rng(12)
    layers = 3  # layer 1 holds the case's pages; the others hold noise the call must not read
    k_stack = jnp.asarray(rng.standard_normal((k.shape[0], layers, *k.shape[1:])), k.dtype).at[:, 1].set(k)
    v_stack = jnp.asarray(rng.standard_normal((v.shape[0], layers, *v.shape[1:])), v.dtype).at[:, 1].set(v)
    if kernel == "reference":
        call = ragged_paged_attention_reference
    else:
        call = functools.partial(KERNELS[kernel], interpret=interpret(kernel), **small(kernel, args))
    step = jax.jit(lambda layer, window, *a: call(*a, layer=layer, sliding_window=window))
    tol = TOL["float32"]
    for window, expect in ((5, 5), (ragged_reference.NO_WINDOW, None)):
        out = step(jnp.int32(1), jnp.int32(window), q, k_stack, v_stack, *meta)
        np.testing.assert_allclose(np.asarray(out, np.float64), oracle(*args, sliding_window=expect),
                                   atol=tol, rtol=tol)


def drop_out_of_window(args, window, page_size=8):
    """The case's block tables as a sliding-window KV-cache group leaves them: every page wholly
    before its sequence's first row's window is the null page (loud garbage)."""
    q, k, v, kv_lens, tables, query_start, num_seqs = args
    tables, lens, starts = np.array(tables), np.asarray(kv_lens), np.asarray(query_start)
    for s in range(int(num_seqs[0])):
        first_row = lens[s] - (starts[s + 1] - starts[s])
        tables[s, : max(0, first_row - window + 1) // page_size] = 0
    return q, k, v, kv_lens, jnp.asarray(tables), query_start, num_seqs


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("window", [5, 13])
def test_pages_before_the_window_on_the_null_page_are_never_read(kernel, window):
    """Decode rows and chunks that straddle the window's edge, over tables whose pages before the
    window point to the null page: kernels, reference and oracle agree, and no garbage leaks."""
    seqs = [(6, 10), (16, 5), (20, 1), (40, 1), (30, 12), (25, 3)]
    args = drop_out_of_window(bucketed(100 + window, seqs), window)
    assert (np.asarray(args[4])[: len(seqs), :2] == 0).sum() >= 4  # pages were dropped
    out = run(kernel, args, sliding_window=window)
    assert np.abs(out).max() < NULL_PAGE_VALUE / 5
    ref = np.asarray(_reference(*args, sliding_window=window), np.float64)
    np.testing.assert_allclose(ref, oracle(*args, sliding_window=window), atol=TOL["float32"], rtol=TOL["float32"])


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_soft_cap_scale_and_window_together(kernel, dtype):
    args = bucketed(7, CASES["mixed"], dtype=dtype)
    run(kernel, args, soft_cap=5.0, sm_scale=0.3, sliding_window=11)
    # The cap matters at this scale: without it the answer differs.
    capped = oracle(*args, soft_cap=5.0, sm_scale=0.3)
    assert np.abs(capped - oracle(*args, sm_scale=0.3)).max() > 1e-2


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("group", [3, 6])
def test_gqa_ratios_not_a_power_of_two(kernel, group):
    """G = 3 and 6 (the sweep below has 1, 4, 8): the GPU kernel pads G to 4 and 8."""
    seqs = [(7, 1), (0, 19), (8, 8), (17, 1), (3, 6)]
    run(kernel, bucketed(group, seqs, group=group, kv_heads=2), sliding_window=9)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_padding_and_rowless_sequences_inside_jit(kernel):
    """Sequences past num_seqs are ignored even with rows and lengths; a real sequence with no
    rows this step, padding tokens and zero-length sequences cost nothing and stay zero. Called
    from inside jit with traced metadata, as the engine's step does."""
    seqs = [(5, 3), (10, 0), (0, 4), (12, 1), (9, 6)]
    q, k, v, lens, tables, starts, _ = bucketed(5, seqs)
    step = jax.jit(lambda *a: KERNELS[kernel](*a, interpret=interpret(kernel), **small(kernel, (q, k))))
    for n in (5, 3, 0):  # at 3, sequences 3 and 4 become padding
        args = (q, k, v, lens, tables, starts, jnp.asarray([n], jnp.int32))
        out = np.asarray(step(*args), np.float64)
        np.testing.assert_allclose(out, oracle(*args), atol=2e-5, rtol=2e-5)
        assert np.all(out[int(starts[n]):] == 0)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_many_decode_rows_per_block_and_default_tuning(kernel):
    """Blocks holding many sequences (decode rows) next to a chunk spanning blocks; default tuning."""
    rng = np.random.default_rng(11)
    seqs = [(int(c), 1) for c in rng.integers(0, 40, 21)] + [(13, 40), (0, 2)]
    run(kernel, make_case(rng, seqs, page_size=16), tuning={})


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_block_sizes_do_not_change_the_answer(kernel):
    args = bucketed(4, CASES["long_chunk"] + CASES["decode"])
    outs = [run(kernel, args, tuning=t, sliding_window=20)
            for t in (dict(block_q=8, pages_per_block=2), dict(block_q=16, pages_per_block=4))]
    np.testing.assert_allclose(outs[0], outs[1], atol=2e-6)


@pytest.mark.parametrize("page_size, head_dim, itemsize, shared_kib, pages", [
    (16, 256, 4, 227, 2),  # Gemma 3 in float32 on an H200: 64 keys asked 288 KiB and failed to compile
    (16, 256, 2, 227, 4),  # in bfloat16 the default 64 keys fit (144 KiB)
    (16, 256, 2, 99, 2),  # but not on a 99 KiB GPU
    (16, 256, 4, None, 4),  # no limit (interpret mode, TPU)
    (16, 256, 4, 64, 1),  # never below one page
    (64, 256, 4, 64, 1),
    (8, 64, 4, 64, 4),  # 64 keys would ask 72 KiB
])
def test_gpu_key_block_fits_shared_memory(page_size, head_dim, itemsize, shared_kib, pages):
    shared = None if shared_kib is None else shared_kib * 1024
    assert default_pages_per_block(page_size, head_dim, itemsize, 32, 2, shared) == pages


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gpu_kv_splits_merge_to_the_same_answer(dtype):
    """The GPU kernel's kv splits (flash-decoding) over every named batch and a sliding window:
    3 splits leave some splits empty for short sequences; a split of a chunk's keys merges into the
    same softmax; rows that see no key stay zero."""
    for name in sorted(CASES):
        args = bucketed(len(name) + 1, CASES[name], dtype=dtype)
        whole = run("gpu", args, sliding_window=11)
        for splits in (2, 3):
            split = run("gpu", args, tuning=dict(small("gpu", args), kv_splits=splits), sliding_window=11)
            np.testing.assert_allclose(split, whole, atol=TOL[jnp.dtype(dtype).name])
            assert np.all(split[real_rows(args):] == 0), name


def test_tpu_dma_chain_has_no_races_on_two_cores():
    """The TPU interpreter's race detector, with the grid's parallel dims split over two simulated
    cores and DMAs executed eagerly: every page copy is waited before its buffer is read, and no
    buffer is refilled while still in use (a kernel without its waits is caught here)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
    from jax.experimental.pallas import tpu as pltpu

    args = bucketed(3, CASES["mixed"] + [(2, 0), (0, 3)])
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2,
                                   dma_execution_mode="eager")
    out = ragged_paged_attention_tpu(*args, interpret=params, block_q=8, pages_per_block=2,
                                     sliding_window=9)
    assert not tpu_interpreter.races.races_found
    np.testing.assert_allclose(np.asarray(out, np.float64), oracle(*args, sliding_window=9),
                               atol=2e-5, rtol=2e-5)


# Orthogonal array L9(3^4): every pair of values of (page_size, head_dim, group) appears once; the
# 4th column picks the dtype so that each value of each axis meets both dtypes.
_L9 = [(0, 0, 0, 0), (0, 1, 1, 2), (0, 2, 2, 1), (1, 0, 1, 1), (1, 1, 2, 0), (1, 2, 0, 2),
       (2, 0, 2, 2), (2, 1, 0, 1), (2, 2, 1, 0)]
_PAGE, _DIM, _GROUP = (8, 16, 32), (64, 128, 256), (1, 4, 8)
_DTYPE = (jnp.float32, jnp.bfloat16, jnp.bfloat16)
SWEEP = [(_DTYPE[d], _PAGE[p], _DIM[h], _GROUP[g]) for p, h, g, d in _L9]


@pytest.mark.parametrize("dtype,page_size,head_dim,group", SWEEP,
                         ids=[f"{jnp.dtype(d).name}-P{p}-D{h}-G{g}" for d, p, h, g in SWEEP])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_sweep_page_size_head_dim_gqa(kernel, dtype, page_size, head_dim, group):
    """Chunks starting and ending on and off page edges, decode rows at P - 1, P, P + 1. Against
    the oracle only: each shape here would compile the reference once more."""
    p = page_size
    seqs = [(p - 1, 1), (p, 1), (0, p + 3), (p + 1, p - 1), (2 * p, p), (1, 1)]
    args = make_case(np.random.default_rng(p * 1000 + head_dim + group), seqs, dtype=dtype,
                     kv_heads=1, group=group, head_dim=head_dim, page_size=p)
    run(kernel, args, tuning=small(kernel, args, pages_per_block=max(1, 16 // p)), reference=False)


def test_matches_jax_shipped_gpu_paged_attention_on_decode():
    """A decode-only batch gives the answer of jax.experimental.pallas.ops.gpu.paged_attention
    (interpret mode). It applies no 1/sqrt(D) scale (so sm_scale=1 here), needs the table width to
    divide into k_splits x pages_per_compute_block, and leaves length 0 unspecified."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu import paged_attention as shipped
    except ImportError as e:  # pragma: no cover - depends on the installed jax
        pytest.skip(f"jax's shipped GPU paged_attention is not importable: {e}")
    seqs = [(0, 1), (14, 1), (15, 1), (16, 1), (63, 1)]
    q, k, v, lens, tables, starts, n = make_case(np.random.default_rng(13), seqs, kv_heads=2,
                                                 group=8, head_dim=64, page_size=16, pad_tokens=0,
                                                 pad_seqs=0, width=4)
    q = q / math.sqrt(64)  # moderate logits with sm_scale=1
    # Both interpreted; their jnp dots would default to TF32 on a GPU.
    with warnings.catch_warnings(), jax.default_matmul_precision("highest"):
        warnings.simplefilter("ignore")
        theirs = shipped.paged_attention(q, k, v, tables, lens, block_h=16,
                                         pages_per_compute_block=2, k_splits=2, interpret=True)
    ours = ragged_paged_attention(q, k, v, lens, tables, starts, n, sm_scale=1.0, interpret=True)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=2e-5, rtol=2e-5)


def _bad_calls():
    q, k, v, lens, tables, starts, n = make_case(np.random.default_rng(0), CASES["decode"])
    ok = (q, k, v, lens, tables, starts, n)
    swap = lambda i, x: ok[:i] + (x,) + ok[i + 1:]  # noqa: E731
    return {  # what is wrong: (args, options, words the message names)
        "query_start shape": (swap(5, starts[:-1]), {}, "query_start"),
        "heads not a multiple": (swap(0, q[:, :3]), {}, "kv heads"),
        "head_dim mismatch": (swap(0, q[..., :16]), {}, "head_dim"),
        "float16": (swap(0, q.astype(jnp.float16)), {}, "float32 or bfloat16"),
        "block_tables rows": (swap(4, tables[:2]), {}, "block_tables"),
        "kv_lens dtype": (swap(3, lens.astype(jnp.float32)), {}, "kv_lens"),
        "num_seqs shape": (swap(6, n[0]), {}, "num_seqs"),
        "k_pages rank": (swap(1, k[0]), {}, "k_pages"),
        "sliding_window 0": (ok, dict(sliding_window=0), "sliding_window"),
        "soft_cap negative": (ok, dict(soft_cap=-1.0), "soft_cap"),
        "block_q 3": (ok, dict(block_q=3), "block_q"),
        "pages_per_block 0": (ok, dict(pages_per_block=0), "pages_per_block"),
    }


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("case", sorted(_bad_calls()))
def test_bad_input_raises_value_error(kernel, case):
    args, options, words = _bad_calls()[case]
    with pytest.raises(ValueError, match=words):
        KERNELS[kernel](*args, interpret=True, **options)


def test_kernel_specific_shape_rules_raise_value_error():
    q, k, v, lens, tables, starts, n = make_case(np.random.default_rng(0), CASES["decode"])
    args = (q, k, v, lens, tables, starts, n)
    with pytest.raises(ValueError, match="rows"):  # Triton dots: R = 2 tokens x 2 heads < 16
        ragged_paged_attention(*args, block_q=2)
    with pytest.raises(ValueError, match="num_warps"):
        ragged_paged_attention(*args, num_warps=0)
    k12 = jnp.zeros((2, 5, 12, 32), jnp.float32)
    with pytest.raises(ValueError, match="powers"):  # Triton blocks: page_size 12
        ragged_paged_attention(q, k12, k12, lens, tables, starts, n)
    with pytest.raises(ValueError, match="multiple of 8"):  # Mosaic: 2 tokens x 2 heads = 4 rows
        ragged_paged_attention_tpu(*args, block_q=2)
    with pytest.raises(ValueError, match="vmem_limit_bytes"):
        ragged_paged_attention_tpu(*args, vmem_limit_bytes=-1)


# ----------------------------------------------------------------------------------------------
# Lowering for the real targets (no accelerator needed): realistic shapes, both dtypes.
# ----------------------------------------------------------------------------------------------

# (q dtype, pool dtype): both bfloat16, both float32, and the engine's default, float32
# activations over a bfloat16 pool.
_DTYPES = ((jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32), (jnp.float32, jnp.bfloat16))
LOWERING = [(dtypes, head_dim, heads) for dtypes in _DTYPES for head_dim in (128, 256)
            for heads in ((8, 1), (12, 4))]
LOWERING_IDS = [f"q{jnp.dtype(a).name}-kv{jnp.dtype(b).name}-D{h}-H{q}/{k}"
                for (a, b), h, (q, k) in LOWERING]


def _abstract(dtypes, head_dim, heads, tokens=512, seqs=64, width=128, pages=2048, page_size=16,
              sharding=None):
    f = lambda shape, d: jax.ShapeDtypeStruct(shape, d, sharding=sharding)  # noqa: E731
    (q_dtype, kv_dtype), (q_heads, kv_heads) = dtypes, heads
    pool = (kv_heads, pages, page_size, head_dim)
    return (f((tokens, q_heads, head_dim), q_dtype), f(pool, kv_dtype), f(pool, kv_dtype),
            f((seqs,), jnp.int32), f((seqs, width), jnp.int32), f((seqs + 1,), jnp.int32),
            f((1,), jnp.int32))


@pytest.fixture
def pin_gpu():
    """jax 0.11 asks the GPU for its compute capability while lowering a Triton kernel: register an
    H100's info for the CPU device kind (jax 0.10 does not ask, and has no such registry)."""
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        yield
        return
    kind = jax.devices()[0].device_kind
    saved = gpu_info.registry.get(kind)
    gpu_info.registry[kind] = functools.partial(gpu_info.get_gpu_info_from_version,
                                                gpu_info.GpuVersion.H100)
    yield
    if saved is None:
        gpu_info.registry.pop(kind, None)
    else:
        gpu_info.registry[kind] = saved


@pytest.mark.parametrize("dtypes,head_dim,heads", LOWERING, ids=LOWERING_IDS)
def test_gpu_kernel_exports_for_cuda_as_a_triton_call(pin_gpu, dtypes, head_dim, heads):
    fn = functools.partial(ragged_paged_attention, sliding_window=512, soft_cap=30.0)
    exported = export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*_abstract(dtypes, head_dim, heads))
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


@pytest.fixture
def pin_tpu_chip():
    """Registers a TPU chip's info for the CPU device kind, so Mosaic lowering (which asks the
    chip for its generation) works on CPU; restores the registry afterwards."""
    from jax._src.pallas.mosaic import tpu_info

    kind = jax.devices()[0].device_kind
    saved = tpu_info.registry.get(kind)

    def pin(chip: str):
        version = {"v5e": tpu_info.ChipVersion.TPU_V5E, "v6e": tpu_info.ChipVersion.TPU_V6E}[chip]
        tpu_info.registry[kind] = functools.partial(tpu_info.get_tpu_info_for_chip, version, 1)
        tpu_info.get_tpu_info.cache_clear()

    yield pin
    if saved is None:
        tpu_info.registry.pop(kind, None)
    else:
        tpu_info.registry[kind] = saved
    tpu_info.get_tpu_info.cache_clear()


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("dtypes,head_dim,heads", LOWERING, ids=LOWERING_IDS)
def test_tpu_kernel_exports_for_tpu_as_a_mosaic_call(pin_tpu_chip, chip, dtypes, head_dim, heads):
    pin_tpu_chip(chip)
    fn = functools.partial(ragged_paged_attention_tpu, sliding_window=512, soft_cap=30.0)
    exported = export.export(jax.jit(fn), platforms=["tpu"])(*_abstract(dtypes, head_dim, heads))
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="needs libtpu (pip install 'libtpu==0.0.42.*' for jax 0.10.2) to run "
                           "the real Mosaic compiler without a TPU")
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_tpu_kernel_compiles_with_mosaic_without_a_tpu(pin_tpu_chip, chip):
    """Deviceless ahead-of-time compile for a TPU topology: runs Mosaic's own layout passes and
    XLA:TPU's memory checks, which export alone does not (e.g. SMEM and VMEM capacity, tile
    alignment of DMA slices)."""
    from jax.experimental import topologies

    pin_tpu_chip(chip)
    topology = topologies.get_topology_desc(topology_name=f"{chip}:1x1", platform="tpu",
                                            chips_per_host_bounds=(1, 1, 1))
    sharding = jax.sharding.SingleDeviceSharding(topology.devices[0])
    for dtypes, head_dim, heads in LOWERING:
        for options in (dict(), dict(sliding_window=512, soft_cap=30.0)):
            fn = functools.partial(ragged_paged_attention_tpu, **options)
            # 512 sequences x 512 pages of block table: more than SMEM holds.
            jax.jit(fn).lower(*_abstract(dtypes, head_dim, heads, tokens=2048, seqs=512, width=512,
                                         sharding=sharding)).compile()

