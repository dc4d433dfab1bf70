"""Which weight dtype each step program runs in, on a CPU: measured on the machine, per bucket.

XLA:CPU's float32 and bfloat16 dots do not rank the same way at every row count, and not the same
way on every CPU. On an AVX2-only AMD EPYC, bfloat16 decoded faster than float32 at 8 sequences
but slower at 1 and at 64; on an AMD EPYC with AVX-512 BF16, a one-row bfloat16 output layer took
10x its float32 form while two rows were twice as fast in bfloat16. So with `dtype="auto"` on a
CPU without bfloat16 dot instructions (below), the engine times, at every bucket and in both
dtypes, the dots that dominate its programs:
the layers' four matrices (qkv, o, gate/up, down) at each token count, run as the model runs them
(a scan over stacked weights, streamed from memory), and the output layer at each row count. Each
program then runs in the dtype that is clearly the faster (by 10% and a millisecond), on a second
copy of the weights where both are used: if that copy makes some decode batch at least 25% faster
and fits in a quarter of the host's available memory; else every program runs in the loaded
dtype. The smallest bucket is one row only where a one-row step is clearly the faster.

Where the CPU has them, the plan came out bfloat16 at every bucket from two rows (an AMD EPYC
with AVX-512 BF16, three runs: float32 saved only the one-row output layer, not a quarter of any
step), so there the weights are bfloat16 and nothing is measured.

The timings are kept in `$JAXSERVE_CACHE/dtype_plans.json`, keyed by everything they depend on
(CPU, jax version, XLA flags, the model's matrix shapes, the buckets): measured once per machine
and model (about 6 s for Gemma 3 270M on 2 cores), read on every later start.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import platform
import time
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from jaxserve.worker.machine import cpu_flags, cpu_model
from jaxserve.model.config import ModelConfig
from jaxserve.model.layers import dense, dense_transposed
from jaxserve.model.transformer import as_bits, from_bits

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")
MARGIN, MIN_GAIN_MS = 0.9, 1.0  # what "clearly faster" takes
COPY_GAIN = 0.75  # a second copy of the weights must make some decode batch 25% faster
MAX_TIMED_BYTES = 128 << 20  # float32 weights timed, of the layers and of the output layer: past any cache
MAX_TIMED_FLOPS = 2e9  # per timed run of the layers: where the dots are compute-bound, fewer layers


@dataclasses.dataclass(frozen=True)
class DtypePlan:
    """Milliseconds per dtype of each program's dominant dots: `forward[T]` (every layer) per
    token bucket, `sample[R]` (the output layer) per row bucket; the dtype the weights were loaded
    in; and whether programs may run on a copy in the other dtype, where it is clearly faster."""

    primary: str
    forward: Mapping[int, Mapping[str, float]]
    sample: Mapping[int, Mapping[str, float]]
    mixed: bool = True
    reason: str = ""  # why not mixed

    def dtype(self, kind: str, size: int) -> str:
        """The dtype of the program `(kind, size)` ("forward" or "sample")."""
        times = (self.forward if kind == "forward" else self.sample)[size]
        best = min(DTYPES, key=times.__getitem__)
        return best if self.mixed and clearly_faster(times[best], times[self.primary]) else self.primary

    def step_ms(self, size: int) -> float:
        """The dots of a step of `size` tokens and rows, each program in its dtype."""
        return self.forward[size][self.dtype("forward", size)] + self.sample[size][self.dtype("sample", size)]

    @property
    def min_rows(self) -> int:
        """The smallest bucket: 1 where a step of one token and one row is clearly faster than one of
        two, else 2 (a one-row bfloat16 dot on XLA:CPU is 5-10x slower than two rows)."""
        both = {1, 2} <= self.forward.keys() & self.sample.keys()
        return 1 if not both or clearly_faster(self.step_ms(1), self.step_ms(2)) else 2

    def decode_ms(self, batch: int) -> float:
        """The dots of a decode step of `batch` sequences, in the bucket it rounds up to."""
        return self.step_ms(min(s for s in self.sample.keys() & self.forward.keys() if s >= max(batch, self.min_rows)))

    def programs(self) -> tuple[tuple[tuple[str, int], str], ...]:
        """((kind, size), dtype) of every program from `min_rows` up (a runner's config, and so
        its compile cache's key)."""
        return tuple(((kind, size), self.dtype(kind, size))
                     for kind, table in (("forward", self.forward), ("sample", self.sample))
                     for size in table if size >= self.min_rows)

    def dtypes(self) -> set[str]:
        return {dtype for _, dtype in self.programs()}

    def describe(self) -> str:
        """Why the programs run in the dtypes they do, in a line."""
        programs = self.programs()
        if len(self.dtypes()) == 1:
            return self.reason or "measured the faster at every bucket"
        parts = []
        for kind, name in (("forward", "layers"), ("sample", "output layer")):
            for dtype in DTYPES:
                sizes = [str(size) for (k, size), d in programs if k == kind and d == dtype]
                if sizes:
                    parts.append(f"{name} at {','.join(sizes)} in {dtype}")
        return "per bucket, measured the faster here: " + "; ".join(parts)


def clearly_faster(ms: float, than: float) -> bool:
    """Faster by 10% and by a millisecond: not by this machine's noise, nor on a tiny model."""
    return ms < MARGIN * than and than - ms >= MIN_GAIN_MS


def plan_for(cfg: ModelConfig, token_sizes, row_sizes, primary: str, cache_file: str,
             measure: Callable | None = None) -> DtypePlan:
    """The plan of this machine for `cfg`'s shapes and these buckets: timings from `cache_file`,
    or measured now (`measure(cfg, token_sizes, row_sizes)`, by default `measure_dots`) and saved.
    Programs leave the loaded dtype only if that makes a decode batch 25% faster, and the copy
    fits in a quarter of the host's available memory."""
    measure = measure or measure_dots
    key = _key(cfg, token_sizes, row_sizes)
    saved = read_timings(cache_file)
    timings = saved.get(key)
    if not _complete(timings, token_sizes, row_sizes):
        start = time.perf_counter()
        timings = measure(cfg, token_sizes, row_sizes)
        log.info("timed the dots of %d buckets in both dtypes in %.1f s", len(token_sizes) + len(row_sizes),
                 time.perf_counter() - start)
        write_timings(cache_file, {**saved, key: timings})
    as_ints = lambda table: {int(size): dict(times) for size, times in table.items()}  # noqa: E731 (JSON keys)
    mixed = DtypePlan(primary, as_ints(timings["forward"]), as_ints(timings["sample"]))
    if mixed.dtypes() == {primary}:
        return mixed
    other = next(iter(set(DTYPES) - {primary}))
    single = dataclasses.replace(mixed, mixed=False)
    if not any(mixed.decode_ms(b) < COPY_GAIN * single.decode_ms(b) for b in row_sizes):
        return dataclasses.replace(single, reason=f"measured: a copy in {other} would make no decode batch "
                                                  f"{1 - COPY_GAIN:.0%} faster")
    if _weight_bytes(cfg, other) > available_memory() // 4:
        return dataclasses.replace(single, reason=f"a copy in {other}, faster at some buckets, would not fit in "
                                                  "a quarter of the available memory")
    return mixed


def measure_dots(cfg: ModelConfig, token_sizes, row_sizes, reps: int = 3) -> dict:
    """Milliseconds per dtype (the best of `reps` runs, the first one cold) of the layers' dots per
    token count, and of the output layer's per row count, each size compiled on its own as the
    engine compiles it (token counts between the most rows and the largest are interpolated). The
    layers run as the model runs them, a scan over stacked weights: at
    most `MAX_TIMED_BYTES` of them, so that they stream from memory as a step's do, and fewer
    where a run would pass `MAX_TIMED_FLOPS` (the dots are compute-bound there); each time is
    then scaled to the whole model."""
    d, layer = cfg.hidden_size, layer_matrices(cfg)
    per_layer = sum(a * b for a, b in layer)
    most = max(1, min(cfg.num_layers, MAX_TIMED_BYTES // (4 * per_layer)))
    vocab = min(cfg.vocab_size, MAX_TIMED_BYTES // (4 * d))
    # Token counts past the most rows are prompt chunks, compute-bound: the largest is timed, and
    # those between are interpolated (each timed size costs a compile).
    timed = [t for t in token_sizes if t <= max(row_sizes) or t == max(token_sizes)]
    timings = {"forward": {}, "sample": {}}
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:  # compiles, while nothing is timed
        for dtype in DTYPES:
            stacked = [as_bits(jnp.zeros((most, *shape), dtype)) for shape in layer]
            head = jnp.zeros((vocab, d), dtype)
            runs = []  # (kind, rows, function, weights, the share of the model's weights they are)
            for t in timed:
                n = max(1, min(most, int(MAX_TIMED_FLOPS // (2 * t * per_layer))))
                runs.append(("forward", t, layer_dots, [w[:n] for w in stacked], n / cfg.num_layers))
            runs += [("sample", r, dense_transposed, head, vocab / cfg.vocab_size) for r in row_sizes]
            compiled = list(pool.map(lambda run: compile_dots(run[2], run[1], d, run[3]), runs))
            for (kind, size, _, weights, share), program in zip(runs, compiled):
                timings[kind].setdefault(str(size), {})[dtype] = best_ms(program, weights, reps) / share
            del stacked, head, runs
    for t in sorted(set(token_sizes) - set(timed)):
        below, above = max(s for s in timed if s < t), min(s for s in timed if s > t)
        at = lambda size, dtype: timings["forward"][str(size)][dtype]  # noqa: E731
        timings["forward"][str(t)] = {dtype: at(below, dtype) + (at(above, dtype) - at(below, dtype))
                                      * (t - below) / (above - below) for dtype in DTYPES}
    return timings


def layer_dots(x, stacked, dot=None, transposed: bool = False, in_place: bool = False):
    """x [T, D] through each layer's qkv, o, gate/up and down matrices, as `Transformer` runs them:
    `dot(x, w)`, by default `dense` on float weights kept as bits (`as_bits`); the matrices
    [in, out], or [out, in] if `transposed`. `in_place`: `dot(x, w, i)` gets the whole stacks and
    the layer i, as int8's CPU kernel reads them (`Transformer.hidden_states`), not a slice."""
    dot = dot or (lambda x, w: dense(x, from_bits(w)))
    # an int8 matrix comes with its scales: its rows are its first leaf's
    rows = lambda w: jax.tree.leaves(w)[0].shape[-1 if transposed else -2]  # noqa: E731

    def layer(x, weights, at=None):
        call = (lambda x, w: dot(x, w, at)) if in_place else dot
        qkv, o, gate_up, down = weights
        x = x + call(call(x, qkv)[:, :rows(o)], o)
        return x + call(call(x, gate_up)[:, :rows(down)], down)
    if in_place:
        return jax.lax.fori_loop(0, jax.tree.leaves(stacked)[0].shape[0], lambda i, x: layer(x, stacked, i), x)
    return jax.lax.scan(lambda x, weights: (layer(x, weights), None), x, stacked)[0]


def compile_dots(fn, rows: int, d: int, weights):
    """`fn(x, weights)` compiled for x [rows, d] (inside one `lax.switch` over the sizes instead,
    XLA:CPU ran a 24-row bfloat16 output layer 6x slower than alone), with its x."""
    x = jnp.ones((rows, d), jnp.float32)
    return jax.jit(fn).lower(x, weights).compile(), x


def best_ms(program, weights, reps: int) -> float:
    compiled, x = program
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(x, weights))
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def layer_matrices(cfg: ModelConfig) -> list[tuple[int, int]]:
    """The shapes of a layer's qkv, o, gate/up and down matrices."""
    d, h = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    return [(d, h + 2 * cfg.num_kv_heads * cfg.head_dim), (h, d), (d, 2 * cfg.intermediate_size),
            (cfg.intermediate_size, d)]


def _weight_bytes(cfg: ModelConfig, dtype: str) -> int:
    """Bytes of the model's matrices in `dtype`: what a second copy of the weights costs."""
    per_layer = sum(a * b for a, b in layer_matrices(cfg))
    matrices = cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    return matrices * jnp.dtype(dtype).itemsize


def available_memory() -> int:
    """Bytes the host can still give (MemAvailable), or 0 where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _key(cfg: ModelConfig, token_sizes, row_sizes) -> str:
    shapes = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
              cfg.vocab_size)
    return " | ".join(map(str, (cpu_model(), platform.machine(), sorted(cpu_flags()), jax.__version__,
                                os.environ.get("XLA_FLAGS", ""), shapes, list(token_sizes), list(row_sizes))))


def _complete(timings, token_sizes, row_sizes) -> bool:
    """Whether saved timings hold both dtypes at every size (a file edited or cut short does not)."""
    try:
        return all(isinstance(timings[kind][str(size)][dtype], (int, float))
                   for kind, sizes in (("forward", token_sizes), ("sample", row_sizes))
                   for size in sizes for dtype in DTYPES)
    except (KeyError, TypeError):
        return False


def read_timings(path: str) -> dict:
    try:
        with open(path) as f:
            saved = json.load(f)
        return saved if isinstance(saved, dict) else {}
    except (OSError, ValueError):
        return {}


def write_timings(path: str, plans: dict) -> None:
    """Saves the timings (whole, or not at all); a folder that cannot be written costs a new
    measurement at the next start, never this one."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(plans, f)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("the timings could not be saved to %s: %s", path, e)
        with contextlib.suppress(OSError):
            os.remove(tmp)
