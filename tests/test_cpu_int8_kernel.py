"""int8's CPU kernel (jaxserve/cpu_kernels/int8_dot.cc): against a float64 numpy reference of the
15-bit integer dot it computes, against XLA's integer dots of split rows (`Int8Dot` without it),
in an engine's steps, and its build."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxserve import Engine, EngineConfig, SamplingParams
from jaxserve.cpu_kernels import int8_dot, library
from jaxserve.engine import resources
from jaxserve.model.loader import cache_root, load_model
from jaxserve.model.quantization import GROUP, Int8Dot, quantize, with_outliers

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler here")


@pytest.fixture(scope="module")
def kernel():
    kernel, why = int8_dot.load(cache_root())
    assert kernel is not None, why
    return kernel


def reference(x: np.ndarray, q: np.ndarray, scale: np.ndarray, transposed: bool) -> np.ndarray:
    """float64: each row of x rounded to 15 bits (a scale of its largest / (127 * 128)), times the int8
    matrix, times the scales of rows and columns."""
    x = np.asarray(x, np.float32)
    row_scale = np.abs(x).max(axis=1, keepdims=True) / np.float32(127 * 128)
    value = np.round(x / row_scale).astype(np.float64)
    w = np.asarray(q, np.float64)
    return (value @ (w.T if transposed else w)) * row_scale * np.asarray(scale, np.float64).reshape(1, -1)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 9])
@pytest.mark.parametrize("k", [48, 2096])
def test_the_kernel_equals_a_float64_reference_of_the_15_bit_integer_dot(kernel, transposed, rows, k):
    """k = 2,096: three chunks of sums, the last of 48 (one or two rows of w [K, N] are read in runs
    of its rows, a chunk's split between the threads)."""
    rng = np.random.default_rng(rows)
    n = 80
    x = rng.standard_normal((rows, k)).astype(np.float32)
    q = rng.integers(-127, 128, (n, k) if transposed else (k, n), dtype=np.int8)
    scale = rng.uniform(1e-3, 1e-2, n).astype(np.float16)
    got = np.asarray(jax.jit(kernel, static_argnums=3)(x, q, scale, transposed))
    want = reference(x, q, scale, transposed)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("transposed", [False, True])
def test_sums_beyond_int32_are_exact_in_their_chunks(kernel, transposed):
    """1,056 products of 127 and 16,256 sum to 2.18e9, past int32: the kernel sums 1,024 at a time."""
    k, n = 1056, 16
    x = np.ones((2, k), np.float32)
    x[1, ::2] = -1
    q = np.full((n, k) if transposed else (k, n), 127, np.int8)
    scale = np.ones(n, np.float16)
    got = np.asarray(kernel(x, q, scale, transposed))
    want = reference(x, q, scale, transposed)
    assert k * 127 * (127 * 128) > 2**31 and np.isclose(want[0, 0], k * 127)  # each value 16,256 at a scale of 1/16,256
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_matrix_the_kernel_does_not_read_is_an_error(kernel):
    x = np.ones((2, 40), np.float32)  # K not a multiple of 16
    with pytest.raises(Exception, match="not a multiple of 16"):
        jax.block_until_ready(kernel(x, np.ones((40, 64), np.int8), np.ones(64, np.float16), False))
    assert not kernel.fits(40, 64) and not kernel.fits(64, 40) and kernel.fits(48, 80)


def test_a_stack_is_read_at_its_index(kernel):
    """The layers' matrices are read in their stacks: a slice would be copied out for the call first."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 32)).astype(np.float32)
    stack = rng.integers(-127, 128, (3, 32, 64), dtype=np.int8)
    scales = rng.uniform(1e-3, 1e-2, (3, 1, 64)).astype(np.float16)
    call = jax.jit(lambda x, w, s, i: kernel(x, w, s, False, i))
    for i in range(3):
        want = kernel(x, stack[i], scales[i], False)
        np.testing.assert_array_equal(np.asarray(call(x, stack, scales, i)), np.asarray(want))
    with pytest.raises(Exception, match="index is out of the stack"):
        jax.block_until_ready(call(x, stack, scales, 3))


def test_int8_dots_by_the_kernel_equal_xlas_integer_dots(kernel):
    """The kernel is an implementation of `Int8Dot`'s integer dots: the same values up to the order of
    float32 sums, for the layers' matrices and both layouts of the output layer; rows past
    `integer_rows` still convert."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 256)).astype(np.float32) * 0.1
    dense = quantize(w, 0, None)
    untied = with_outliers(*quantize(w, 0, GROUP), 0, 8)
    tied = with_outliers(*quantize(w.T, 1, GROUP), 1, 8)
    transposed = quantize(w.T, 1, None)  # the layers held [out, in]
    xla, ours = (Int8Dot("int8", "float32", 64, None, 8, 4, k) for k in (None, kernel))
    held = [dataclasses.replace(d, layers_transposed=True) for d in (xla, ours)]
    for rows in (1, 4, 7):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        want = np.asarray(jax.jit(lambda x: held[0].dense(x, *transposed))(x))
        got = np.asarray(jax.jit(lambda x: held[1].dense(x, *transposed))(x))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
        for dot in (lambda d: d.dense(x, *dense), lambda d: d.output_layer(x, *untied[:2], False, *untied[2:]),
                    lambda d: d.output_layer(x, *tied[:2], True, *tied[2:])):
            want = np.asarray(jax.jit(lambda x: dot(xla))(x))
            got = np.asarray(jax.jit(lambda x: dot(ours))(x))
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_an_engine_with_the_kernel_decodes_the_tokens_of_xlas_integer_dots(checkpoints, kernel, monkeypatch):
    cfg, weights, tokenizer = load_model(checkpoints("gemma3"))[:3]
    config = EngineConfig(dtype="float32", quantization="int8", max_slots=4, page_size=8, num_pages=64,
                          max_model_len=128)
    prompts = [[5, 17, 40, 9], list(range(3, 30)), [7] * 11]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    monkeypatch.setattr(resources, "planned_integer_rows", lambda *a, **kw: ((4, 8), "integer dots up to 4 and 8 rows"))
    engine = Engine(cfg, weights, tokenizer, config)
    assert engine.runner.quant.kernel == kernel and "(a CPU kernel)" in engine.describe()

    def kernel_calls(key) -> list[str]:
        jitted, args = engine.runner.program(key)
        return [line for line in jitted.lower(*args).as_text().splitlines() if int8_dot.TARGET in line]
    sample = next(key for key in engine.runner.all_programs() if key[0] == "sample")
    assert len(kernel_calls(sample)) == 1  # the output layer
    layers = kernel_calls(("forward", engine.runner.buckets.token_sizes[0]))
    in_stacks = [c for c in layers if re.search(rf"tensor<{cfg.num_layers}x\d+x\d+xi8>", c)]
    assert len(layers) == len(in_stacks) == 4  # the layers' qkv, o, gate/up and down, read in their stacks
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim  # held [out, in] for the kernel
    assert engine.runner.quant.layers_transposed and f"tensor<{cfg.num_layers}x{qkv}x{cfg.hidden_size}xi8>" in layers[0]
    got = engine.generate(prompts, greedy)
    monkeypatch.setattr(resources, "load_int8_kernel", lambda folder: (None, "no kernel"))
    xla = Engine(cfg, weights, tokenizer, config)
    quant = xla.runner.quant
    assert quant.kernel is None and (quant.integer_rows, quant.output_integer_rows) == (4, 8)
    assert [o.token_ids for o in got] == [o.token_ids for o in xla.generate(prompts, greedy)]


def test_the_build_is_kept_and_a_missing_compiler_leaves_xlas_dots(tmp_path, monkeypatch):
    path = library.build(cache_root(), "int8_dot")
    assert os.path.basename(path) == int8_dot.load(cache_root())[0].library
    built = os.stat(path).st_mtime_ns
    assert library.build(cache_root(), "int8_dot") == path  # read back, not rebuilt
    assert os.stat(path).st_mtime_ns == built
    kernel = int8_dot.load(cache_root())[0]
    assert int8_dot.load(str(tmp_path))[0] == kernel  # a process registers one build
    monkeypatch.setattr(int8_dot, "_loaded", {})  # as a new process
    monkeypatch.setenv("CXX", "no-such-compiler")
    kernel, why = int8_dot.load(str(tmp_path))
    assert kernel is None and "no C++ compiler (no-such-compiler)" in why


PORTABLE = '''
import sys
import numpy as np
from jaxserve.cpu_kernels import int8_dot, library
library.FLAGS = tuple(f for f in library.FLAGS if not f.startswith("-march")) + ("-march=x86-64",)
kernel, why = int8_dot.load(sys.argv[1])
assert kernel is not None, why
rng = np.random.default_rng(0)
x = rng.standard_normal((5, 48)).astype(np.float32)
for transposed in (False, True):
    q = rng.integers(-127, 128, (80, 48) if transposed else (48, 80), dtype=np.int8)
    scale = rng.uniform(1e-3, 1e-2, 80).astype(np.float16)
    np.save(f"{sys.argv[1]}/{transposed}.npy", np.asarray(kernel(x, q, scale, transposed)))
    np.savez(f"{sys.argv[1]}/{transposed}-inputs.npz", x=x, q=q, scale=scale)
'''


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the portable build is checked on x86-64")
def test_the_portable_loops_built_without_avx2_compute_the_same(tmp_path):
    """Every CI machine has AVX2, so the loops for CPUs without it are built here for plain x86-64
    (in a process of their own: one kernel is registered a process) and checked the same way."""
    subprocess.run([sys.executable, "-c", PORTABLE, str(tmp_path)], check=True, timeout=300,
                   env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert "__AVX2__" not in subprocess.run(["c++", "-march=x86-64", "-E", "-dM", "-x", "c++", "-"], input="",
                                             capture_output=True, text=True, check=True).stdout
    for transposed in (False, True):
        inputs = np.load(tmp_path / f"{transposed}-inputs.npz")
        want = reference(inputs["x"], inputs["q"], inputs["scale"], transposed)
        got = np.load(tmp_path / f"{transposed}.npy")
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
