"""Where start-up goes: per step program, tracing, lowering, XLA compile and the first calls; for
the model, making the weights and moving them to the device. On Gemma 3 270M's shapes with random
weights (no download, no torch).

    python scripts/bench_startup.py                       # 18 layers, a few shapes
    python scripts/bench_startup.py --layers 1,6,18 --tokens 2,16,256 --rows 2,32
    python scripts/bench_startup.py --warmup              # Runner.warmup() of every program, timed whole
    python scripts/bench_startup.py --load                # the default model's load, phase by phase

Each phase is timed on its own: `jit(...).trace(args)`, `.lower()`, `.compile()`, then a first
and a second step of that shape (a step runs forward, then sample: a sample program's first step
also compiles the forward program it needs, hence the listed order). No compile cache is used.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.host_memory import keep_freed_memory
from jaxserve.model.config import ModelConfig
from jaxserve.model.transformer import Transformer
from jaxserve.model.weights import expected_shapes
from jaxserve.worker.runner import Runner, RunnerConfig

# Gemma 3 270M (google/gemma-3-270m config.json); see scripts/random_checkpoint.py.
PERIOD = (512,) * 5 + (None,)


def gemma3_270m(layers: int) -> ModelConfig:
    windows = (PERIOD * 4)[:layers]
    return ModelConfig(family="gemma3", vocab_size=262_144, hidden_size=640, intermediate_size=2048,
                       num_layers=layers, num_heads=4, num_kv_heads=1, head_dim=256,
                       max_position_embeddings=32_768, rope_theta=1e6, tie_embeddings=True, qk_norm=True,
                       activation="gelu_tanh", layer_windows=windows,
                       layer_rope_thetas=tuple(1e4 if w else 1e6 for w in windows), embed_scale=640 ** 0.5,
                       sandwich_norms=True, query_scale=256 ** -0.5, eos_token_ids=(1,))


def random_weights(cfg: ModelConfig) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {name: (rng.standard_normal(shape, np.float32) * 0.02) for name, shape in expected_shapes(cfg).items()}


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def program_phases(runner: Runner, key: tuple) -> dict[str, float]:
    """Seconds of each phase of one program, from nothing: trace, lower, compile, two calls (the
    forward program's calls include the sampler's, already compiled)."""
    jitted, args = runner.program(key)
    traced, t_trace = timed(lambda: jitted.trace(*args))
    lowered, t_lower = timed(traced.lower)
    compiled, t_compile = timed(lowered.compile)
    runner._compiled[key] = compiled
    size = key[-1]
    batch = runner.padding_batch(size, runner.buckets.min_rows) if key[0] == "forward" else \
        runner.padding_batch(runner.buckets.token_sizes[0], size)
    _, t_first = timed(lambda: runner.step(batch, logprobs=key[0] == "logprobs"))
    _, t_second = timed(lambda: runner.step(batch, logprobs=key[0] == "logprobs"))
    return dict(trace=t_trace, lower=t_lower, compile=t_compile, first=t_first, second=t_second)


def load_phases(dtype: str) -> None:
    """The default model's load: GGUF read and dequantize, Orbax save (the first start's cache),
    Orbax restore (every later start), and the weights onto the device (stacked for the scan)."""
    import tempfile

    from jaxserve.model.checkpoint import restore_checkpoint, save_checkpoint
    from jaxserve.model.default_model import default_model_path
    from jaxserve.model.gguf_loader import load_gguf
    path, t_path = timed(default_model_path)
    (cfg, weights), t_gguf = timed(lambda: load_gguf(path, dtype))
    with tempfile.TemporaryDirectory() as folder:
        _, t_save = timed(lambda: save_checkpoint(folder + "/ckpt", cfg, weights))
        (_, restored), t_restore = timed(lambda: restore_checkpoint(folder + "/ckpt", dtype))
    model, t_device = timed(lambda: jax.block_until_ready(Transformer(cfg, restored, jnp.dtype(dtype))))
    mb = sum(w.nbytes for w in restored.values()) / 2**20
    print(f"# default model, {dtype}, {mb:.0f} MiB: GGUF out of its package {t_path:.1f} s, read and dequantize "
          f"{t_gguf:.1f} s, Orbax save {t_save:.1f} s, Orbax restore {t_restore:.1f} s, to the device "
          f"(stacked) {t_device:.1f} s")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="18")
    parser.add_argument("--tokens", default="2,16,256", help="forward programs: token buckets, comma-separated")
    parser.add_argument("--rows", default="2,32", help="sample and logprobs programs: row buckets")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--warmup", action="store_true", help="time Runner.warmup() of every program instead")
    parser.add_argument("--load", action="store_true", help="time the default model's load instead")
    args = parser.parse_args(argv)
    keep_freed_memory()  # as the engine process does
    jax.config.update("jax_enable_compilation_cache", False)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, dtype {args.dtype}")
    if args.load:
        return load_phases(args.dtype)
    print(f"{'layers':>6} {'program':>14} {'trace':>7} {'lower':>7} {'compile':>8} {'first':>7} {'second':>7}")
    for layers in map(int, args.layers.split(",")):
        cfg = gemma3_270m(layers)
        weights, t_weights = timed(lambda: random_weights(cfg))
        model, t_model = timed(lambda: Transformer(cfg, weights, jnp.dtype(args.dtype)))
        runner = Runner(model, RunnerConfig(num_pages=512, page_size=16, max_slots=32, max_model_len=2048,
                                            max_num_batched_tokens=256, kv_dtype=args.dtype))
        print(f"# {layers} layers: random weights {t_weights:.1f} s, to device {t_model:.1f} s")
        if args.warmup:  # alone: a program timed above would be in jax's in-memory caches
            n, t = timed(runner.warmup)
            print(f"# {layers} layers: warmup() compiled {n} programs ({len(runner.buckets.token_sizes)} token "
                  f"and {len(runner.buckets.row_sizes)} row buckets) "
                  f"in {t:.1f} s on {os.cpu_count()} threads", flush=True)
            continue
        keys = [("sample", int(r)) for r in args.rows.split(",")]
        keys += [("logprobs", k[1]) for k in keys]
        keys += [("forward", int(t)) for t in args.tokens.split(",")]
        for key in keys:
            p = program_phases(runner, key)
            print(f"{layers:>6} {'-'.join(map(str, key)):>14} {p['trace']:>7.2f} {p['lower']:>7.2f} {p['compile']:>8.2f} "
                  f"{p['first']:>7.3f} {p['second']:>7.3f}", flush=True)


if __name__ == "__main__":
    main()
