"""jaxserve's int8 dots beside qwix's (Google's JAX quantization library) on Gemma 3 270M's shapes,
on this machine: the decode step's two largest dots at two rows (XLA:CPU's one-row bfloat16 dot is
a trap, so a one-sequence step runs two), random weights.

    pip install qwix==0.1.8 && python scripts/bench_qwix.py

For each form it prints the median ms of a call and the compiled program's temporary bytes: a
whole float copy of the int8 weights shows there (the output layer's is 335 MB in bfloat16).
"""

from __future__ import annotations

import argparse
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from bench_kernels import time_fn  # scripts/, beside this file

from jaxserve.model.quantization import Int8Dot, block_rows, quantize
from jaxserve.model.transformer import as_bits, from_bits

HIDDEN, GATE_UP, LAYERS, VOCAB, ROWS = 640, 2 * 2048, 18, 262_144, 2


def timed(fn, *args, reps: int) -> tuple[float, int]:
    """(median ms of a call, temporary bytes of the compiled program)."""
    compiled = jax.jit(fn).lower(*args).compile()
    return time_fn(compiled, args, reps) * 1e3, compiled.memory_analysis().temp_size_in_bytes


def layers_forms(w: np.ndarray) -> dict:
    """x [R, D] through LAYERS stacked [D, N] matrices in a scan, each layer's input the one before's
    output, per form: (function, its weights). Float weights go in as bits, as the model keeps them
    (else XLA:CPU converts the whole bfloat16 stack to float32 before the loop)."""
    def scan(dot):
        def run(x, weights):
            def layer(h, lw):
                return h + 0.01 * dot(h, jax.tree.map(from_bits, lw))[:, :HIDDEN], None
            return jax.lax.scan(layer, x, weights)[0]
        return run

    ours = Int8Dot("int8", "bfloat16")
    ours_w8a8 = Int8Dot("w8a8", "bfloat16", group=None)
    q32, s32 = jax.vmap(lambda m: _ours_quantize(m, 0, 32))(jnp.asarray(w))
    qc, sc = jax.vmap(lambda m: _ours_quantize(m, 0, None))(jnp.asarray(w))
    dims = (((1,), (0,)), ((), ()))
    return {
        "bfloat16": (scan(lambda x, lw: jax.lax.dot_general(x.astype(jnp.bfloat16), lw, dims,
                                                                preferred_element_type=jnp.float32)),
                     as_bits(jnp.asarray(w, jnp.bfloat16))),
        "jaxserve int8 (a scale per 32)": (scan(lambda x, lw: ours.dense(x, *lw)), (q32, s32)),
        "jaxserve w8a8": (scan(lambda x, lw: ours_w8a8.dense(x, *lw)), (qc, sc)),
        "qwix int8, a scale per channel": (scan(lambda x, lw: qwix.dot_general(x.astype(jnp.bfloat16), lw, dims)),
                                           _qwix(w, channelwise_axes=(0, 2))),
        "qwix int8, a scale per 32": (scan(lambda x, lw: qwix.dot_general(x.astype(jnp.bfloat16), lw, dims)),
                                      _qwix(w, channelwise_axes=(0, 2), tiled_axes={1: 32})),
        "qwix w8a8": (scan(lambda x, lw: qwix.dot_general(
            qwix.quantize(x, jnp.int8, channelwise_axes=(0,)), lw, dims)), _qwix(w, channelwise_axes=(0, 2))),
    }


def output_forms(e: np.ndarray) -> dict:
    """x [R, D] times a tied embedding e [V, D], per form: (function, its weights)."""
    dims = (((1,), (1,)), ((), ()))
    ours = Int8Dot("int8", "bfloat16", block_rows=block_rows(VOCAB, HIDDEN))
    ours_w8a8 = Int8Dot("w8a8", "bfloat16", group=None)
    q32, s32 = _ours_quantize(jnp.asarray(e), 1, 32)
    qc, sc = _ours_quantize(jnp.asarray(e), 1, None)
    return {
        "bfloat16": (lambda x, w: jax.lax.dot_general(x.astype(jnp.bfloat16), w, dims,
                                                       preferred_element_type=jnp.float32),
                     jnp.asarray(e, jnp.bfloat16)),
        "jaxserve int8 (a scale per 32)": (lambda x, w: ours.output_layer(x, *w, tied=True), (q32, s32)),
        "jaxserve w8a8": (lambda x, w: ours_w8a8.output_layer(x, *w, tied=True), (qc, sc)),
        "qwix int8, a scale per channel": (lambda x, w: qwix.dot_general(x.astype(jnp.bfloat16), w, dims),
                                           _qwix(e, channelwise_axes=(0,))),
        "qwix int8, a scale per 32": (lambda x, w: qwix.dot_general(x.astype(jnp.bfloat16), w, dims),
                                      _qwix(e, channelwise_axes=(0,), tiled_axes={1: 32})),
        "qwix w8a8": (lambda x, w: qwix.dot_general(qwix.quantize(x, jnp.int8, channelwise_axes=(0,)), w, dims),
                      _qwix(e, channelwise_axes=(0,))),
    }


def _ours_quantize(w, axis, group):
    return quantize(w, axis, group, jnp)


def _qwix(w: np.ndarray, **how) -> qwix.QArray:
    """w as qwix's int8 array (its scales in bfloat16, as jaxserve's are float16)."""
    return jax.jit(lambda a: qwix.quantize(a, jnp.int8, scale_dtype=jnp.bfloat16, **how))(
        jnp.asarray(w, jnp.float32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(f"{jax.default_backend()}: {model}; jax {jax.__version__}, qwix 0.1.8; {ROWS} rows\n")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((ROWS, HIDDEN)), jnp.float32)
    print("| form | gate/up, 18 layers: ms, temp MB | output layer 262,144 x 640: ms, temp MB |")
    print("|---|---|---|")
    layers = layers_forms(rng.standard_normal((LAYERS, HIDDEN, GATE_UP)).astype(np.float32) * 0.05)
    output = output_forms(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) * 0.05)
    for name in layers:
        cells = []
        for forms in (layers, output):
            fn, w = forms[name]
            ms, temp = timed(fn, x, w, reps=args.reps)
            cells.append(f"{ms:.1f}, {temp / 2**20:.0f}")
        print(f"| {name} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
