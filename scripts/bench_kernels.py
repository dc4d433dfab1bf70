"""Benchmark paged decode attention: our Pallas kernel vs the XLA reference vs jax's shipped kernel.

For each point of a grid (slots, context length, q/kv heads, head_dim, page size) it times

  ours       jaxserve.pallas_kernels.backend.decode_attention(backend="pallas")
             (GPU: Triton-style kernel; TPU: scalar-prefetch kernel; CPU: interpret mode)
  reference  the plain-jnp gather reference (what the engine runs on CPU)
  shipped    jax.experimental.pallas.ops.gpu.paged_attention (GPU-style; skipped on TPU)

and reports achieved bandwidth = bytes of K/V the slots actually need (2 * S * K * ctx * D *
itemsize) / time, next to the device's measured copy bandwidth (a large `x + 1`: read + write).
Absolute numbers only mean something on an accelerator; on CPU use `--quick` to check the script
runs (kernels in interpret mode there are orders of magnitude slower than XLA, as expected).

  python scripts/bench_kernels.py --quick                 # tiny grid, CPU-friendly
  python scripts/bench_kernels.py --json out.json         # full grid on an accelerator
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.pallas_kernels import backend, paged_attention_reference  # noqa: E402

FULL_GRID = dict(slots=(8, 64), context=(512, 4096), heads=((8, 1), (32, 8)),
                 head_dim=(128, 256), page_size=(16, 32))
QUICK_GRID = dict(slots=(2,), context=(40,), heads=((4, 2),), head_dim=(64,), page_size=(8, 16))


def time_fn(fn, args, iters: int) -> float:
    """Median wall time of `fn(*args)` in seconds, after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, iters: int) -> float:
    """Device copy bandwidth in bytes/s: `x + 1` reads and writes nbytes each."""
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    fn = jax.jit(lambda a: a + 1)
    return 2 * x.nbytes / time_fn(fn, (x,), iters)


def make_inputs(rng, slots, context, q_heads, kv_heads, head_dim, page_size, dtype):
    pages_per_seq = math.ceil(context / page_size)
    num_pages = 1 + slots * pages_per_seq
    shape = (kv_heads, num_pages, page_size, head_dim)
    k = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    q = jnp.asarray(rng.standard_normal((slots, q_heads, head_dim), np.float32), dtype)
    table = rng.permutation(np.arange(1, num_pages)).reshape(slots, pages_per_seq)
    lengths = np.full((slots,), context, np.int32)
    return q, k, v, jnp.asarray(table, jnp.int32), jnp.asarray(lengths)


def shipped_fn(pages_per_seq: int, interpret: bool):
    """jax's shipped GPU kernel with split sizes that divide pages_per_seq, or None."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from jax.experimental.pallas.ops.gpu import paged_attention as shipped
        except ImportError:
            return None
    k_splits = next(s for s in (16, 8, 4, 2, 1) if pages_per_seq % s == 0)
    per_split = pages_per_seq // k_splits
    ppcb = next(b for b in (8, 4, 2, 1) if per_split % b == 0)
    return jax.jit(lambda q, k, v, t, n: shipped.paged_attention(
        q, k, v, t, n, pages_per_compute_block=ppcb, k_splits=k_splits, interpret=interpret))


def run(args) -> dict:
    platform = jax.default_backend()
    interpret = args.interpret or platform == "cpu"
    dtype = jnp.dtype(args.dtype)
    grid = QUICK_GRID if args.quick else FULL_GRID
    copy_bytes = (64 << 20) if (args.quick or platform == "cpu") else (1 << 30)
    peak = copy_bandwidth(copy_bytes, args.iters)
    print(f"platform={platform} device={jax.devices()[0].device_kind} dtype={dtype.name} "
          f"interpret={interpret} copy bandwidth={peak / 1e9:.1f} GB/s")
    rng = np.random.default_rng(0)
    rows = []
    header = f"{'S':>4} {'ctx':>6} {'H/K':>6} {'D':>4} {'P':>3} | " + " | ".join(
        f"{name:>24}" for name in ("ours ms GB/s %copy", "reference", "shipped"))
    print(header)
    for slots, context, (q_heads, kv_heads), head_dim, page_size in itertools.product(
            grid["slots"], grid["context"], grid["heads"], grid["head_dim"], grid["page_size"]):
        inputs = make_inputs(rng, slots, context, q_heads, kv_heads, head_dim, page_size, dtype)
        kv_bytes = 2 * slots * kv_heads * context * head_dim * dtype.itemsize
        impls = {
            "ours": jax.jit(lambda *a: backend.decode_attention(
                *a, backend="pallas", interpret=interpret)),
            "reference": jax.jit(lambda *a: paged_attention_reference(*a)),
        }
        if platform != "tpu":
            fn = shipped_fn(inputs[3].shape[1], interpret)
            if fn is not None:
                impls["shipped"] = fn
        row = dict(slots=slots, context=context, q_heads=q_heads, kv_heads=kv_heads,
                   head_dim=head_dim, page_size=page_size, kv_bytes=kv_bytes)
        cells = []
        for name in ("ours", "reference", "shipped"):
            if name not in impls:
                row[name] = None
                cells.append(f"{'n/a':>24}")
                continue
            try:
                seconds = time_fn(impls[name], inputs, args.iters)
            except Exception as e:  # a kernel that cannot run on this shape/platform
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                cells.append(f"{'error':>24}")
                continue
            gbps = kv_bytes / seconds / 1e9
            row[name] = dict(ms=seconds * 1e3, gb_per_s=gbps, pct_copy=100 * kv_bytes / seconds
                             / peak)
            cells.append(f"{seconds * 1e3:9.3f} {gbps:7.1f} {row[name]['pct_copy']:6.1f}%")
        rows.append(row)
        print(f"{slots:>4} {context:>6} {q_heads:>3}/{kv_heads:<2} {head_dim:>4} {page_size:>3} | "
              + " | ".join(cells))
    return dict(platform=platform, device_kind=jax.devices()[0].device_kind,
                jax_version=jax.__version__, dtype=dtype.name, interpret=interpret,
                copy_bandwidth_gb_per_s=peak / 1e9, iters=args.iters, rows=rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny grid (runs on CPU)")
    parser.add_argument("--interpret", action="store_true",
                        help="run Pallas kernels in interpret mode (always on CPU)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--iters", type=int, default=None,
                        help="timed calls per point (default 3 quick, 20 full)")
    parser.add_argument("--json", type=Path, default=None, help="write results to this file")
    args = parser.parse_args(argv)
    if args.iters is None:
        args.iters = 3 if args.quick else 20
    result = run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
