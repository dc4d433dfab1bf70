"""Benchmark ragged paged attention: our Pallas kernel vs the plain-jnp reference (and, on a
decode-only batch, jax's shipped GPU paged_attention kernel).

Each workload is one engine step: a list of sequences `(cached, chunk)`, `cached` tokens already in
the pool and `chunk` query rows this step (1 = a decode row), flattened into one ragged batch.

  ours       the ragged kernel for this platform: GPU -> Triton-style
             `ragged_paged_attention`, TPU -> Mosaic `ragged_paged_attention_tpu`, CPU -> the
             GPU-style kernel in interpret mode (or `--kernel tpu` for the TPU one, slower)
  reference  `ragged_paged_attention_reference` under jit (the engine's CPU attention)
  shipped    jax.experimental.pallas.ops.gpu.paged_attention, decode-only workloads, not on TPU

It prints time, achieved bandwidth = bytes the step must read (each sequence's K/V once, plus q and
the output) / time, that bandwidth as a share of the device's measured copy bandwidth (a large
`x + 1`: read + write), and attention TFLOP/s (4 H D per visible query-key pair). Absolute numbers
only mean something on an accelerator; on CPU, `--quick --interpret` checks that the script runs
(kernels in interpret mode are orders of magnitude slower than XLA there, as expected).

  python scripts/bench_kernels.py --quick --interpret     # tiny grid, CPU-friendly
  python scripts/bench_kernels.py --json out.json         # full grid on an accelerator
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.pallas_kernels.ragged_paged_attention import ragged_paged_attention  # noqa: E402
from jaxserve.pallas_kernels.ragged_reference import ragged_paged_attention_reference  # noqa: E402


def workloads(quick: bool) -> dict[str, list[tuple[int, int]]]:
    """Named steps: decode only, prefill only, mixed (decodes next to prompt chunks)."""
    if quick:
        return {"decode": [(39, 1), (12, 1)], "prefill": [(0, 16), (5, 11)],
                "mixed": [(20, 1), (0, 12), (8, 8), (3, 1)]}
    return {
        "decode 64x4k": [(4095, 1)] * 64,
        "decode 256x1k": [(1023, 1)] * 256,
        "prefill 1x2k": [(0, 2048)],
        "prefill 4x512 @1k": [(1024, 512)] * 4,
        "mixed 64x2k + 2x512": [(2047, 1)] * 64 + [(1024, 512)] * 2,
    }


FULL_GRID = dict(heads=((32, 8), (8, 1)), head_dim=(128,), page_size=(16,))
QUICK_GRID = dict(heads=((4, 2),), head_dim=(64,), page_size=(8, 16))


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
    return 2 * x.nbytes / time_fn(jax.jit(lambda a: a + 1), (x,), iters)


def make_step(rng, seqs, q_heads, kv_heads, head_dim, page_size, dtype):
    """(q, k_pages, v_pages, kv_lens, block_tables, query_start, num_seqs) of one step."""
    lens = [c + n for c, n in seqs]
    used = [-(-n // page_size) for n in lens]
    num_pages = 1 + sum(used)
    pool = (kv_heads, num_pages, page_size, head_dim)
    k = jnp.asarray(rng.standard_normal(pool, np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(pool, np.float32), dtype)
    perm = rng.permutation(np.arange(1, num_pages))
    tables = np.zeros((len(seqs), max(used)), np.int32)
    offset = 0
    for s, n in enumerate(used):
        tables[s, :n] = perm[offset: offset + n]
        offset += n
    starts = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(starts[-1]), q_heads, head_dim), np.float32), dtype)
    return (q, k, v, jnp.asarray(lens, jnp.int32), jnp.asarray(tables), jnp.asarray(starts),
            jnp.asarray([len(seqs)], jnp.int32))


def step_cost(seqs, q_heads, kv_heads, head_dim, itemsize):
    """(bytes the step must move, attention FLOPs) for causal rows without a window."""
    kv_bytes = sum(2 * kv_heads * (c + n) * head_dim * itemsize for c, n in seqs)
    rows = sum(n for _, n in seqs)
    qo_bytes = 2 * rows * q_heads * head_dim * itemsize
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in seqs)  # visible (query, key) pairs
    return kv_bytes + qo_bytes, 4 * q_heads * head_dim * pairs


def shipped_decode(args, interpret: bool):
    """jax's shipped GPU paged_attention on a decode-only step (it applies no 1/sqrt(D) scale: the
    difference does not change the cost), with split sizes dividing the table width; or None."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from jax.experimental.pallas.ops.gpu import paged_attention as shipped
        except ImportError:
            return None
    width = args[4].shape[1]
    k_splits = next(s for s in (16, 8, 4, 2, 1) if width % s == 0)
    per_split = width // k_splits
    ppcb = next(b for b in (8, 4, 2, 1) if per_split % b == 0)
    fn = jax.jit(lambda q, k, v, lens, tables: shipped.paged_attention(
        q, k, v, tables, lens, pages_per_compute_block=ppcb, k_splits=k_splits, interpret=interpret))
    return lambda q, k, v, lens, tables, starts, n: fn(q, k, v, lens, tables)


def ours_fn(kernel: str, interpret: bool, tuning: dict):
    if kernel == "tpu":
        from jaxserve.pallas_kernels.tpu_ragged_paged_attention import ragged_paged_attention_tpu
        impl = ragged_paged_attention_tpu
    else:
        impl = ragged_paged_attention
    return jax.jit(functools.partial(impl, interpret=interpret, **tuning))


def run(args) -> dict:
    platform = jax.default_backend()
    interpret = args.interpret or platform == "cpu"
    kernel = args.kernel if args.kernel != "auto" else ("tpu" if platform == "tpu" else "gpu")
    dtype = jnp.dtype(args.dtype)
    grid = QUICK_GRID if args.quick else FULL_GRID
    tuning = {k: v for k, v in (("block_q", args.block_q), ("pages_per_block", args.pages_per_block),
                                ("kv_splits", args.kv_splits)) if v is not None}
    copy_bytes = (64 << 20) if (args.quick or platform == "cpu") else (1 << 30)
    peak = copy_bandwidth(copy_bytes, args.iters)
    device = jax.devices()[0].device_kind
    print(f"platform={platform} device={device} kernel={kernel} dtype={dtype.name} "
          f"interpret={interpret} tuning={tuning or 'default'} copy bandwidth={peak / 1e9:.1f} GB/s")
    names = ("ours", "reference", "shipped")
    print(f"{'workload':>20} {'H/N':>6} {'D':>4} {'P':>3} | "
          + " | ".join(f"{n + ' ms GB/s %copy TF/s':>31}" for n in names))
    rng = np.random.default_rng(0)
    rows = []
    for (name, seqs), (q_heads, kv_heads), head_dim, page_size in itertools.product(
            workloads(args.quick).items(), grid["heads"], grid["head_dim"], grid["page_size"]):
        step = make_step(rng, seqs, q_heads, kv_heads, head_dim, page_size, dtype)
        nbytes, flops = step_cost(seqs, q_heads, kv_heads, head_dim, dtype.itemsize)
        impls = {"ours": ours_fn(kernel, interpret, tuning),
                 "reference": jax.jit(ragged_paged_attention_reference)}
        if platform != "tpu" and all(n == 1 for _, n in seqs):
            fn = shipped_decode(step, interpret)
            if fn is not None:
                impls["shipped"] = fn
        row = dict(workload=name, seqs=len(seqs), tokens=int(step[0].shape[0]), q_heads=q_heads,
                   kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, bytes=nbytes,
                   flops=flops)
        cells = []
        for impl in names:
            if impl not in impls:
                row[impl] = None
                cells.append(f"{'n/a':>31}")
                continue
            try:
                seconds = time_fn(impls[impl], step, args.iters)
            except Exception as e:  # a kernel that cannot run on this shape or platform
                row[impl] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                cells.append(f"{'error':>31}")
                continue
            gbps, tflops = nbytes / seconds / 1e9, flops / seconds / 1e12
            row[impl] = dict(ms=seconds * 1e3, gb_per_s=gbps, pct_copy=100 * nbytes / seconds / peak,
                             tflop_per_s=tflops)
            cells.append(f"{seconds * 1e3:9.3f} {gbps:7.1f} {row[impl]['pct_copy']:6.1f}% {tflops:6.2f}")
        rows.append(row)
        print(f"{name:>20} {q_heads:>3}/{kv_heads:<2} {head_dim:>4} {page_size:>3} | " + " | ".join(cells))
    return dict(platform=platform, device_kind=device, jax_version=jax.__version__, kernel=kernel,
                dtype=dtype.name, interpret=interpret, tuning=tuning,
                copy_bandwidth_gb_per_s=peak / 1e9, iters=args.iters, rows=rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny grid (runs on CPU)")
    parser.add_argument("--interpret", action="store_true",
                        help="run Pallas kernels in interpret mode (always on CPU)")
    parser.add_argument("--kernel", default="auto", choices=("auto", "gpu", "tpu"),
                        help="which kernel is 'ours' (auto: tpu on TPU, else gpu)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--block-q", type=int, default=None, help="kernel tuning: tokens per program")
    parser.add_argument("--pages-per-block", type=int, default=None,
                        help="kernel tuning: pages per key block")
    parser.add_argument("--kv-splits", type=int, default=None,
                        help="GPU kernel tuning: programs sharing one query block's keys (default: auto)")
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
