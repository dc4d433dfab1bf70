"""Decode throughput against batch size, beside this machine's roofline.

    python scripts/bench_decode.py                         # Gemma 3 270M, float32 and the default dtype
    python scripts/bench_decode.py --batches 1,2,4,16,64 --context 256 --dtypes float32,bfloat16
    python scripts/bench_decode.py --budget-sweep 64,128,256,512,1024   # what max_num_batched_tokens buys
    python scripts/bench_decode.py --attention --batches 1,16,64 --context 256  # attention vs bandwidth
    python scripts/bench_decode.py --attention --batches 16 --context 4096 --spread 2048 --window 512
    python scripts/bench_decode.py --sampling                # sampling on 16 rows of the model's logits
    python scripts/bench_decode.py --dtypes float32,bfloat16,auto --hide-bf16-flags  # auto's measured plan
    python scripts/bench_decode.py --int8-layers --batches 1,2,8,32   # the kernel's two layer layouts

For each dtype and batch size B it times the engine's compiled step on B decode tokens (each
sequence holding `--context` tokens in the pool) and prints tokens/s, the step's FLOPs and the
bytes it must read (weights once, plus every sequence's K/V), and the roofline bound
min(peak FLOP/s / FLOPs, bandwidth / bytes) x B, from this machine's measured matmul peak (a 2048^3
dot in each dtype) and read bandwidth (a sum over 512 MiB: a step reads its weights and K/V; a
copy's read-plus-write figure, printed beside it, is lower on CPU and would flatter the step). Also
the output layer's dot at one, two and 32 rows in float32, bfloat16 and int8 (an integer dot): one
row against two decides the smallest decode bucket on CPU, and int8 against bfloat16 at 32 rows
whether int8 can gain where the dots are compute-bound. `--budget-sweep` times steps of 16 decode
rows plus one prompt chunk filling each token budget: tokens/s grows with the budget while every
decode waits a whole step, so the default budget is the smallest that reaches most of the
throughput.
`--attention` times one layer's decode attention (Gemma 3 270M shapes) over a float32 and a
bfloat16 pool against reading its K/V once at the measured read bandwidth, its decode rows in
jnp and, on a CPU, by the C++ kernel (`jaxserve.cpu_kernels.decode_attention`). `--sampling` times
the jitted `sample` on 16 rows of the model's own float32 logits (after 16 prefixes of one text),
for greedy, a temperature, and the top-k, top-p and min-p cuts. `--int8-layers` times the
model's layers' int8 dots (qkv, o, gate/up and down of every layer, read in their stacks) by the
CPU kernel (`jaxserve.cpu_kernels.int8_dot`) with the matrices held [in, out] and [out, in]
(`Int8Dot.layers_transposed`), the two alternating `--reps` times.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import Engine, EngineConfig
from jaxserve.entrypoints.engine_args import quantization_arg
from jaxserve.worker import machine
from jaxserve.host_memory import keep_freed_memory
from jaxserve.worker.kv_pool import allocate_kv_pool
from jaxserve.model.kv_groups import kv_groups
from jaxserve.model.loader import load_model
from jaxserve.model.transformer import Transformer
from jaxserve.pallas_kernels.backend import attention_fn
from jaxserve.worker.sampling import SamplingBatch, sample
from jaxserve.worker.step_batch import ScheduledSeq, StepBuckets, StepSeqs, build_step, table_metadata, table_updates


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak(dtype, n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of an n^3 dot in `dtype` with float32 accumulation (int8: int32 sums, operations/s)."""
    a = jnp.asarray(np.random.default_rng(0).integers(-100, 100, (n, n)), dtype)
    dot = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=_accumulator(dtype)))
    return 2 * n ** 3 / timed(lambda: dot(a).block_until_ready(), reps)


def copy_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """Bytes/s read plus written by a large elementwise copy."""
    x = jnp.ones(mib << 18, jnp.float32)
    copy = jax.jit(lambda v: v + 1)
    return 2 * x.nbytes / timed(lambda: copy(x).block_until_ready(), reps)


def read_bandwidth(mib: int = 512, reps: int = 5) -> float:
    """Bytes/s read by a sum over a large array (what attention does to the pool)."""
    x = jnp.ones(mib << 18, jnp.float32)
    total = jax.jit(jnp.sum)
    return x.nbytes / timed(lambda: total(x).block_until_ready(), reps)


def attention_sweep(args, batches: list[int], bandwidth: float) -> None:
    """One layer's decode attention, Gemma 3 270M shapes (4 query heads, 1 kv head, head dim 256):
    the reference's decode rows in jnp, and by the CPU kernel where it builds."""
    from jaxserve.cpu_kernels import decode_attention
    from jaxserve.model.loader import cache_root
    from jaxserve.worker.kv_pool import storage_dtype
    from jaxserve.pallas_kernels.ragged_reference import ragged_paged_attention_reference
    kernel = decode_attention.load(cache_root())[0] if jax.default_backend() == "cpu" else None
    print("\n| pool | decode rows | batch | context | K/V bytes | ms | GB/s | at bandwidth ms | x of reading once |")
    print("|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    context = (f"{args.context}" + (f"±{args.spread}" if args.spread else "")
               + (f", window {args.window}" if args.window else ""))
    page, pages_per_seq = 16, -(-(args.context + args.spread) // 16)
    width = max(128, pages_per_seq)
    num_pages = 1 + max(batches) * pages_per_seq + 64
    implementations = [(name, jax.jit(functools.partial(ragged_paged_attention_reference, decode_rows=rows,
                                                        sliding_window=args.window)))
                       for name, rows in [("jnp", None)] + ([("CPU kernel", kernel)] if kernel else [])]
    for dtype in ("float32", "bfloat16"):
        k, v = (jnp.asarray(rng.standard_normal((1, num_pages, page, 256)), jnp.dtype(dtype)) for _ in range(2))
        if storage_dtype(dtype, as_bits=True) == jnp.uint16:  # as the engine keeps it on CPU
            k, v = (jax.lax.bitcast_convert_type(a, jnp.uint16) for a in (k, v))
        for b in batches:
            tables = np.zeros((b, width), np.int32)
            tables[:, :pages_per_seq] = 1 + rng.permutation(b * pages_per_seq).reshape(b, pages_per_seq)
            q = jnp.asarray(rng.standard_normal((b, 4, 256)), jnp.float32)
            lens = np.linspace(args.context - args.spread, args.context + args.spread, b).astype(np.int32)
            inputs = (q, k, v, jnp.asarray(lens), jnp.asarray(tables), jnp.arange(b + 1, dtype=jnp.int32),
                      jnp.array([b], jnp.int32))  # on the device before the timing, as a step's are
            held = np.minimum(lens, args.window) if args.window else lens  # what the layer must read
            nbytes = 2 * int(held.sum()) * 256 * jnp.dtype(dtype).itemsize
            ideal = nbytes / bandwidth
            for name, attend in implementations:
                seconds = timed(lambda: attend(*inputs).block_until_ready(), args.reps)
                print(f"| {dtype} | {name} | {b} | {context} | {nbytes / 2**20:.1f} MiB | {seconds * 1e3:.2f} | "
                      f"{nbytes / seconds / 1e9:.1f} | {ideal * 1e3:.2f} | {seconds / ideal:.1f} |", flush=True)


def int8_layer_sweep(args, batches: list[int]) -> None:
    """The default model's layers' int8 dots on `batches` rows by the CPU kernel, read in their
    stacks as the engine reads them, in both layouts; random int8 weights of the model's shapes."""
    from jaxserve.cpu_kernels import int8_dot
    from jaxserve.model.loader import cache_root
    from jaxserve.model.quantization import Int8Dot
    from jaxserve.worker.dtype_plan import layer_dots, layer_matrices
    kernel, why = int8_dot.load(cache_root())
    if kernel is None:
        return print(why)
    cfg = load_model(args.model)[0]
    rng = np.random.default_rng(0)
    shapes = layer_matrices(cfg)  # [in, out]
    stacks = [(rng.integers(-127, 128, (cfg.num_layers, *shape), dtype=np.int8),
               rng.random((cfg.num_layers, 1, shape[1]), dtype=np.float32)) for shape in shapes]
    nbytes = sum(q.nbytes for q, _ in stacks)
    layouts = {}
    for transposed in (False, True):
        quant = Int8Dot("int8", "float32", 0, None, 0, max(batches), kernel, layers_transposed=transposed)
        held = [tuple(jnp.asarray(a.swapaxes(1, 2) if transposed else a) for a in matrix) for matrix in stacks]
        layers = functools.partial(layer_dots, dot=lambda x, qs, at, quant=quant: quant.dense(x, *qs, at),
                                   transposed=transposed, in_place=True)
        layouts["[out, in]" if transposed else "[in, out]"] = (jax.jit(layers), held)
    print(f"\n{cfg.num_layers} layers' int8 matrices, {nbytes / 1e6:.1f} MB, by the CPU kernel; median ms of "
          f"{args.reps} alternating runs")
    print("| rows | " + " | ".join(f"{name} ms | GB/s" for name in layouts) + " | [in, out] / [out, in] |")
    print("|---|" + "---|---|" * len(layouts) + "---|")
    for rows in batches:
        x = jnp.asarray(rng.standard_normal((rows, cfg.hidden_size)), jnp.float32)
        for fn, held in layouts.values():
            fn(x, held).block_until_ready()
        times = {name: [] for name in layouts}
        for _ in range(args.reps):
            for name, (fn, held) in layouts.items():
                start = time.perf_counter()
                fn(x, held).block_until_ready()
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        cells = " | ".join(f"{m:.2f} | {nbytes / m / 1e6:.1f}" for m in ms.values())
        print(f"| {rows} | {cells} | {ms['[in, out]'] / ms['[out, in]']:.2f}x |", flush=True)


GROUPS = 6  # KV-cache groups of the default model (Gemma 3 270M): a table per group, pages apart


SAMPLING_TEXT = ("Once upon a time, in a small village by the sea, there lived an old clockmaker who spent his "
                 "days repairing the watches of fishermen and telling stories to the children who gathered in his shop.")


def model_logits(model_path: str | None, rows: int, page: int = 16) -> np.ndarray:
    """float32 logits [rows, V]: the model's next-token scores after `rows` prefixes of one text,
    all in one step (one sequence per prefix)."""
    cfg, weights, tokenizer, _ = load_model(model_path)
    ids = tokenizer.encode(SAMPLING_TEXT)
    lengths = np.linspace(4, len(ids), rows).astype(int)
    width, groups = -(-len(ids) // page), kv_groups(cfg).num_groups
    tables = 1 + np.arange(rows * groups * width, dtype=np.int32).reshape(rows, groups, width)  # pages apart
    step = build_step(StepSeqs.of([ScheduledSeq(i, 0, ids[:n]) for i, n in enumerate(lengths)]), rows, page,
                      StepBuckets(max_tokens=int(lengths.sum()), max_seqs=rows))
    meta = table_metadata(step.meta, tables, step.seq_slots, step.token_seq_slots, page)
    pool = allocate_kv_pool(cfg, 1 + rows * groups * width, page, jnp.float32)
    logits, _ = Transformer(cfg, weights)(jnp.asarray(step.tokens), pool, meta, attend=attention_fn("reference"),
                                          logits_indices=jnp.asarray(step.logits_indices))
    return np.asarray(logits)


def sampling_sweep(args, rows: int = 16) -> None:
    logits = jnp.asarray(model_logits(args.model, rows))
    cases = {"greedy": dict(temperature=0.0), "temperature 1": {}, "top-k 50": dict(top_k=50),
             "top-p 0.9": dict(top_p=0.9), "top-p 0.95": dict(top_p=0.95), "top-k 50, top-p 0.9": dict(top_k=50, top_p=0.9),
             "min-p 0.05": dict(min_p=0.05)}
    draw = jax.jit(sample)
    positions = jnp.arange(rows, dtype=jnp.int32)
    print(f"\n| sampling ({rows} rows of {logits.shape[1]} logits) | ms |")
    print("|---|---|")
    for name, options in cases.items():
        o = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | options
        params = SamplingBatch(np.full(rows, o["temperature"], np.float32), np.full(rows, o["top_k"], np.int32),
                               np.full(rows, o["top_p"], np.float32), np.full(rows, o["min_p"], np.float32),
                               np.arange(rows, dtype=np.uint32))
        seconds = timed(lambda: draw(logits, params, positions).block_until_ready(), args.reps)
        print(f"| {name} | {seconds * 1e3:.1f} |", flush=True)


def output_layer_forms(reps: int = 20) -> dict[str, float]:
    """ms of a [rows, 640] x [640, 262144] output layer in the forms the model may take: float32,
    bfloat16 weights, and int8 weights in an integer dot (int8 rows, int32 sums: w8a8's form, and
    int8's split rows). The smallest decode bucket on CPU follows from one row against two; at 32
    rows the dots are compute-bound, so int8 gains there only if this backend's integer dot is faster."""
    rng = np.random.default_rng(0)
    w32 = jnp.asarray(rng.standard_normal((640, 262144)) * 0.02, jnp.float32)
    weights = {"float32": w32, "bf16 weights": w32.astype(jnp.bfloat16),
               "int8 weights": jnp.asarray(rng.integers(-127, 128, (640, 262144)), jnp.int8)}
    out = {}
    for rows in (1, 2, 32):
        for name, w in weights.items():
            if name == "int8 weights" and rows == 1:
                continue  # int8's one-token steps run two rows (split rows), w8a8's a padded second
            x = jnp.ones((rows, 640), w.dtype)
            dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=_accumulator(b.dtype)))
            out[f"{name} x{rows}"] = timed(lambda: dot(x, w).block_until_ready(), reps) * 1e3
    return out


def _accumulator(dtype):
    return jnp.int32 if jnp.dtype(dtype) == jnp.int8 else jnp.float32


def decode_step_time(engine: Engine, batch: int, context: int, reps: int) -> float:
    runner, page = engine.runner, engine.config.page_size
    pages, groups = -(-context // page), runner.kv_groups.num_groups
    tables = np.zeros((engine.config.max_slots, groups, runner.pages_per_seq), np.int32)
    tables[:batch, :, :pages] = 1 + np.arange(batch * groups * pages).reshape(batch, groups, pages)
    seqs = StepSeqs.of([ScheduledSeq(i, context - 1, [1000 + i]) for i in range(batch)])
    return timed_steps(runner, build_step(seqs, engine.config.max_slots, page, runner.buckets, runner.replicas,
                                          table_updates(tables), sampling_mode="greedy"), reps)


def mixed_step_time(engine: Engine, budget: int, decodes: int, context: int, reps: int) -> float:
    """A step of `decodes` decode rows at `context` tokens plus one prompt chunk of the rest of the budget."""
    runner, page, slots = engine.runner, engine.config.page_size, engine.config.max_slots
    groups = runner.kv_groups.num_groups
    tables = np.zeros((slots, groups, runner.pages_per_seq), np.int32)
    pages = -(-context // page)
    tables[:decodes, :, :pages] = 1 + np.arange(decodes * groups * pages).reshape(decodes, groups, pages)
    chunk = budget - decodes
    chunk_pages = -(-chunk // page)
    tables[decodes, :, :chunk_pages] = 1 + decodes * groups * pages + np.arange(groups * chunk_pages).reshape(
        groups, chunk_pages)
    seqs = [ScheduledSeq(i, context - 1, [1000 + i]) for i in range(decodes)]
    seqs.append(ScheduledSeq(decodes, 0, list(range(1000, 1000 + chunk))))
    return timed_steps(runner, build_step(StepSeqs.of(seqs), slots, page, runner.buckets, runner.replicas,
                                          table_updates(tables), sampling_mode="greedy"), reps)


def timed_steps(runner, step, reps: int) -> float:
    """Seconds per run of `step`, its block tables written to the device once before."""
    runner.step(step)
    step.table_updates = step.table_updates[:0]
    return timed(lambda: runner.step(step), reps)


def budget_sweep(args, budgets: list[int]) -> None:
    print("\n| dtype | budget | step ms (every decode's ITL) | tokens/s | of the best |")
    print("|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        engine = Engine.from_pretrained(args.model, EngineConfig(
            dtype=dtype, max_slots=32, max_num_batched_tokens=max(budgets), max_model_len=2048,
            num_pages=1 + 17 * 128))
        rows = [(b, mixed_step_time(engine, b, 16, args.context, args.reps)) for b in budgets]
        best = max(b / t for b, t in rows)
        for b, t in rows:
            print(f"| {dtype} | {b} | {t * 1e3:.1f} | {b / t:.0f} | {b / t / best:.0%} |", flush=True)
        del engine


def step_cost(engine: Engine, batch: int, context: int) -> tuple[float, float]:
    """(FLOPs, bytes) of a decode step: matmuls at 2 FLOPs per weight per token, attention at 4
    per cached key and head dim; weights read once, K/V read once per sequence."""
    cfg, runner = engine.model_config, engine.runner
    weights = sum(x.size for x in jax.tree.leaves(runner.state) if x.ndim >= 2)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.state))
    kv_itemsize = runner.kv_pool[0].dtype.itemsize
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * context * kv_itemsize
    flops = 2 * weights + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
    return batch * flops, weight_bytes + batch * kv_bytes


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: Gemma 3 270M)")
    p.add_argument("--dtypes", default="float32,auto")
    p.add_argument("--quantizations", default="none", help="comma-separated: none, int8, w8a8, auto")
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--context", type=int, default=128, help="tokens each sequence holds")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--budget-sweep", default=None, help="comma-separated token budgets: time mixed steps instead")
    p.add_argument("--attention", action="store_true", help="time one layer's decode attention instead")
    p.add_argument("--spread", type=int, default=0,
                   help="--attention: sequences hold context-spread to context+spread tokens, evenly")
    p.add_argument("--window", type=int, default=None, help="--attention: a sliding-window layer's window")
    p.add_argument("--sampling", action="store_true", help="time sampling on the model's logits instead")
    p.add_argument("--int8-layers", action="store_true",
                   help="time the layers' int8 dots by the CPU kernel in both layouts instead")
    p.add_argument("--hide-bf16-flags", action="store_true",
                   help="dtype auto as on a CPU without bfloat16 dot instructions: loaded in float32, and each "
                        "bucket's dtype measured (jaxserve.worker.dtype_plan); the dots still run at this CPU's speeds")
    args = p.parse_args(argv)
    if not 0 <= args.spread < args.context:
        p.error(f"--spread must be in [0, --context), got {args.spread}")
    keep_freed_memory()  # the engine's heap, before jax starts: no buffer re-faulted on each call
    if args.hide_bf16_flags:
        flags = machine.cpu_flags() - machine.BF16_FLAGS
        machine.cpu_flags = lambda: flags
        machine.auto_weights_dtype.cache_clear()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(f"CPU: {model}; jax {jax.__version__}, backend {jax.default_backend()}")
    if args.sampling:
        return sampling_sweep(args)
    if args.int8_layers:
        return int8_layer_sweep(args, [int(b) for b in args.batches.split(",")])
    peak32, peak16, bandwidth = matmul_peak(jnp.float32), matmul_peak(jnp.bfloat16), read_bandwidth()
    print(f"roofline: 2048^3 dot {peak32 / 1e9:.0f} GFLOP/s float32, {peak16 / 1e9:.0f} GFLOP/s bfloat16, "
          f"{matmul_peak(jnp.int8) / 1e9:.0f} GOP/s int8; "
          f"read {bandwidth / 1e9:.1f} GB/s (copy, read + written: {copy_bandwidth() / 1e9:.1f} GB/s)")
    if args.budget_sweep:
        return budget_sweep(args, [int(b) for b in args.budget_sweep.split(",")])
    if args.attention:
        return attention_sweep(args, [int(b) for b in args.batches.split(",")], bandwidth)
    print("output layer 640x262144, ms: " + ", ".join(f"{k} {v:.1f}" for k, v in output_layer_forms().items()))
    batches = [int(b) for b in args.batches.split(",")]
    print("\n| dtype | batch | step ms | tok/s | GFLOP/s | GB/s | roofline tok/s | of roofline |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, quantization in itertools.product(args.dtypes.split(","), args.quantizations.split(",")):
        max_model_len = max(512, args.context + 1)
        seqs_pages = max(max(batches) * -(-args.context // 16), -(-max_model_len // 16))  # one full sequence fits too
        engine = Engine.from_pretrained(args.model, EngineConfig(
            dtype=dtype, max_slots=max(batches), max_num_batched_tokens=max(256, max(batches)),
            max_model_len=max_model_len, quantization=quantization_arg(quantization),
            num_pages=1 + GROUPS * seqs_pages))
        peak = peak32 if engine.runner.dtype == "float32" else peak16
        label = f"{dtype}: {'/'.join(sorted(engine.runner.states))}"  # "auto" may mix dtypes per bucket
        if engine.runner.quant is not None:
            label += f", {engine.runner.quant.mode} weights"
        for b in batches:
            seconds = decode_step_time(engine, b, args.context, args.reps)
            flops, nbytes = step_cost(engine, b, args.context)
            bound = min(peak / flops, bandwidth / nbytes) * b
            print(f"| {label} | {b} | {seconds * 1e3:.1f} | {b / seconds:.1f} | {flops / seconds / 1e9:.0f} "
                  f"| {nbytes / seconds / 1e9:.1f} | {bound:.0f} | {b / seconds / bound:.0%} |", flush=True)
        del engine


if __name__ == "__main__":
    main()
