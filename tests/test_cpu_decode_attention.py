"""Decode attention's CPU kernel (jaxserve/cpu_kernels/decode_attention.cc): the reference attention
with its decode rows computed by the kernel, against the same attention in jnp and a float64
oracle (float32 and bfloat16 pools, GQA, windows, soft cap, padding, the stacked pool); in an
engine's steps; and its portable loops."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import Engine, EngineConfig, SamplingParams
from jaxserve.cpu_kernels import decode_attention
from jaxserve.engine import resources
from jaxserve.model.loader import cache_root, load_model
from jaxserve.pallas_kernels.ragged_reference import ragged_paged_attention_reference
from ragged_cases import CASES, make_case, oracle

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler here")

# Against jnp's decode rows: float32 alike but for the order of the sums; a bfloat16 pool's
# probabilities are rounded after a running maximum in jnp, after the whole row's in the kernel.
CLOSE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def kernel():
    kernel, why = decode_attention.load(cache_root())
    assert kernel is not None, why
    return kernel


def both(kernel, args, **options):
    """(the reference with the kernel's decode rows, the reference in jnp) on `args`."""
    def run(rows):
        return np.asarray(jax.jit(lambda *a: ragged_paged_attention_reference(*a, **options, decode_rows=rows))(*args),
                          np.float64)
    return run(kernel), run(None)


@pytest.mark.parametrize("name", ["decode", "mixed", "page_edges"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernels_rows_equal_jnps_and_the_oracle(kernel, name, dtype):
    args = make_case(np.random.default_rng(len(name)), CASES[name], dtype=dtype)
    got, want = both(kernel, args)
    np.testing.assert_allclose(got, want, atol=CLOSE[dtype], rtol=CLOSE[dtype])
    np.testing.assert_allclose(got, oracle(*args), atol=2 * CLOSE[dtype], rtol=2 * CLOSE[dtype])


@pytest.mark.parametrize("group", [1, 3, 6])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, None), (13, 4.0)])
def test_gqa_windows_and_soft_cap(kernel, group, window, soft_cap):
    """Groups of 3 and 6 heads: the values are summed four heads at a time, then the rest."""
    seqs = [(0, 1), (6, 1), (17, 1), (30, 1), (4, 6)]
    args = make_case(np.random.default_rng(group), seqs, group=group)
    options = dict(sliding_window=window, soft_cap=soft_cap)
    got, want = both(kernel, args, **options)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got, oracle(*args, **options), atol=2e-5, rtol=2e-5)


def test_the_stacked_pool_in_place_and_bfloat16_bits(kernel):
    """The engine's pool: [N, layers, M, P, D], a layer picked by a traced index, bfloat16 kept as
    its uint16 bits (`jaxserve.worker.kv_pool`)."""
    q, k, v, *meta = make_case(np.random.default_rng(5), CASES["decode"], dtype=jnp.bfloat16)
    rng = np.random.default_rng(6)
    noise = lambda: jnp.asarray(rng.standard_normal(k.shape), jnp.bfloat16)  # noqa: E731
    def stack(pages):  # layer 1 of three, as bits
        return jax.lax.bitcast_convert_type(jnp.stack([noise(), pages, noise()], axis=1), jnp.uint16)
    run = jax.jit(lambda layer, *a: ragged_paged_attention_reference(*a, layer=layer, decode_rows=kernel))
    got = np.asarray(run(jnp.int32(1), q, stack(k), stack(v), *meta), np.float64)
    want = np.asarray(jax.jit(ragged_paged_attention_reference)(q, k, v, *meta), np.float64)
    np.testing.assert_allclose(got, want, atol=1e-2, rtol=1e-2)
    assert np.all(got[len(CASES["decode"]):] == 0)  # padding tokens


def test_a_long_context_and_a_page_outside_the_pool(kernel):
    """Keys past one block of 64, a window of them; one sequence on one kv head, whose keys the
    threads split when it holds 512 of them or more, window or not; a block table naming a page the
    pool does not have is the kernel's error, not a read out of bounds."""
    for seqs, kv_heads in (([(300, 1), (129, 1), (64, 1)], 2), ([(900, 1)], 1)):
        args = make_case(np.random.default_rng(9), seqs, page_size=16, head_dim=64, pad_seqs=0, kv_heads=kv_heads,
                         group=4)
        for window in (None, 100, 600):
            got, want = both(kernel, args, sliding_window=window)
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    q, k, v, lens, tables, starts, seqs = args
    with pytest.raises(Exception, match="outside the pool"):
        both(kernel, (q, k, v, lens, tables.at[0, 3].set(k.shape[1]), starts, seqs))


def test_an_engine_decodes_with_the_kernel_as_with_jnp(checkpoints, monkeypatch, kernel):
    """A tiny Gemma 3 (sliding and global layers): the forward program calls the kernel in its layers'
    loop, on the pool in place (no copy of it), and its greedy tokens are jnp's."""
    cfg, weights, tokenizer = load_model(checkpoints("gemma3"))[:3]
    config = EngineConfig(dtype="float32", max_slots=4, page_size=8, num_pages=64, max_model_len=128)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = Engine(cfg, weights, tokenizer, config)
    assert engine.runner.config.decode_kernel == kernel and "decode rows by a CPU kernel" in engine.describe()
    jitted, args = engine.runner.program(("forward", engine.runner.buckets.token_sizes[0]))
    lowered = jitted.lower(*args)
    assert lowered.as_text().count(decode_attention.TARGET) == 1  # in the layers' scan
    pool = "[" + ",".join(map(str, engine.runner.kv_pool[0].shape)) + "]"
    assert not [line for line in lowered.compile().as_text().splitlines() if pool in line and " copy(" in line]
    got = engine.generate(prompts, greedy)
    monkeypatch.setattr(resources, "load_decode_kernel", lambda folder: (None, "no kernel"))
    jnp_engine = Engine(cfg, weights, tokenizer, config)
    assert jnp_engine.runner.config.decode_kernel is None
    assert [o.token_ids for o in got] == [o.token_ids for o in jnp_engine.generate(prompts, greedy)]


PORTABLE = '''
import sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, sys.argv[2])
from ragged_cases import make_case
from jaxserve.cpu_kernels import decode_attention, library
from jaxserve.pallas_kernels.ragged_reference import ragged_paged_attention_reference
library.FLAGS = tuple(f for f in library.FLAGS if not f.startswith("-march")) + ("-march=x86-64",)
kernel, why = decode_attention.load(sys.argv[1])
assert kernel is not None, why
for dtype in (jnp.float32, jnp.bfloat16):
    args = make_case(np.random.default_rng(1), [(0, 1), (9, 1), (40, 1), (3, 4)], dtype=dtype, group=3)
    got = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sliding_window=20, decode_rows=kernel))(*args)
    want = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sliding_window=20))(*args)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), atol=tol, rtol=tol)
'''


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the portable build is checked on x86-64")
def test_the_portable_loops_built_without_avx2_compute_the_same(tmp_path):
    """Built for plain x86-64 in a process of its own (one build is registered a process)."""
    subprocess.run([sys.executable, "-c", PORTABLE, str(tmp_path), os.path.dirname(__file__)], check=True,
                   timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
