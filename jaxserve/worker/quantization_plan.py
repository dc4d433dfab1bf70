"""What `quantization="auto"` resolves to: float or int8 weights, whichever runs a decode step's dots
faster on this machine; and up to how many rows int8's dots are integer dots here.

A batch-1 decode step reads every weight once: its time is the layers' four matrices and the output
layer at the smallest row bucket. Both forms are timed as the model runs them (`Int8Dot` for int8),
on at most `MAX_TIMED_BYTES` of each, scaled to the whole model; int8 is chosen where it is clearly
faster (10% and a millisecond, as in `dtype_plan`). w8a8 is never chosen: on Gemma 3 270M it agreed
with bfloat16 on 89% of a text's next tokens (docs/quantization.md).

Integer dots (`Int8Dot.integer_rows`): XLA:CPU converts a whole int8 operand before a float dot,
while its integer dot of the activations split in two int8 rows each (`split_rows`) reads the
int8 weights as they are. Which is faster depends on the CPU and the row count, not only on its
int8 dot instructions: with AVX-512 VNNI (AMD EPYC) integer dots won at 1 and 2 rows and lost at
8; on an AVX2-only AMD EPYC they tied at 1 row and won at 2 and 4 (docs/quantization.md); the
engine's C++ kernel for them (`jaxserve.cpu_kernels.int8_dot`, where it builds) won at every count
up to 256 there (a prompt chunk's rows too), on the output layer by more than on the layers. So
both forms are timed at `INTEGER_CANDIDATES` rows, for the layers and the output layer apart
(`PARTS`), and each part takes integer dots up to the most rows at which they were clearly faster,
or tied after a win (stopping at the first row count where they were clearly slower). On GPUs and TPUs XLA fuses the conversion
into the dot: no integer dots.

The timings are kept in `$JAXSERVE_CACHE/quantization_plans.json`, keyed by the CPU, jax, the XLA
flags, the shapes and the dtype: measured once per machine and model (and once per process).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.config import ModelConfig
from jaxserve.model.layers import dense_transposed
from jaxserve.model.quantization import GROUPS, OUTLIERS, STORED, Int8Dot, block_rows, quantize_on_device, with_outliers
from jaxserve.model.transformer import as_bits
from jaxserve.worker.dtype_plan import (MAX_TIMED_BYTES, best_ms, clearly_faster, compile_dots, layer_dots, layer_matrices,
                                        read_timings, write_timings)
from jaxserve.worker.machine import cpu_flags, cpu_model

log = logging.getLogger(__name__)
# the int8 dots timed: a new form times again
FORM = "int8 layers per channel ([out, in] and read in their stacks with a kernel), output layer with float channels"
INTEGER_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # row counts at which integer and converted dots are timed
PARTS = ("layers", "output layer")  # of a step's dots, each with its own integer rows
MIN_TIMED_INT8_BYTES = 32 << 20  # smaller models take converted dots untimed: read in about a millisecond
_chosen: dict[str, tuple[int, int]] = {}  # integer rows chosen in this process, by key: one choice per process


def auto_quantization(cfg: ModelConfig, dtype: str, rows: int, cache_file: str, measure=None,
                      integer_rows: tuple[int, int] = (0, 0), kernel=None) -> tuple[str | None, str]:
    """("int8" or None, why) for a model of `cfg` in `dtype` decoding `rows` rows at the least,
    int8's dots integer dots up to `integer_rows` rows (the layers', the output layer's; by
    `kernel`, `Int8Dot.kernel`);
    `measure(cfg, dtype, rows)` gives {"none": ms, "int8": ms} (default: `measure_decode_dots`).
    A measurement that fails leaves the weights float."""
    kernel = kernel if any(integer_rows) else None
    key = _key(FORM, cfg, dtype, rows, *integer_rows, *([kernel] if kernel else []))
    measure = measure or functools.partial(measure_decode_dots, integer_rows=integer_rows, kernel=kernel)
    saved = read_timings(cache_file)
    timings = saved.get(key)
    if not (isinstance(timings, dict) and all(isinstance(timings.get(k), (int, float)) for k in ("none", "int8"))):
        start = time.perf_counter()
        try:
            timings = measure(cfg, dtype, rows)
        except Exception as e:  # noqa: BLE001 — auto never fails: float weights, as without it
            log.warning("could not time int8 dots here (%s): the weights stay %s", e, dtype)
            return None, f"auto: int8 dots could not be timed here ({type(e).__name__}: {e})"
        log.info("timed a decode step's dots in %s and int8 in %.1f s", dtype, time.perf_counter() - start)
        write_timings(cache_file, {**saved, key: timings})
    mode = "int8" if clearly_faster(timings["int8"], timings["none"]) else None
    return mode, (f"auto: a decode step's dots at {rows} row{'s' * (rows > 1)} measured here, "
                  f"{timings['none']:.1f} ms in {dtype}, {timings['int8']:.1f} ms in int8")


def integer_rows(cfg: ModelConfig, dtype: str, cache_file: str, measure=None, kernel=None
                 ) -> tuple[tuple[int, int], str]:
    """((up to how many rows the layers' int8 dots are integer dots, the output layer's), why) for a
    model of `cfg` in `dtype`, computed by `kernel` (`Int8Dot.kernel`; None: XLA's integer dot);
    `measure(rows, parts)` gives {part: {"converted": ms, "integer": ms}} at `rows` rows for each of
    `parts` (of `PARTS`; default: `DecodeDots.integer_timings`). 0 on GPUs and TPUs, in a multi-host
    group, and where the measurement fails."""
    if jax.default_backend() != "cpu":
        return (0, 0), "XLA fuses int8's conversion into the dot here"
    if jax.process_count() > 1:  # each process would time its own: a group's programs must be the same
        return (0, 0), "converted dots: a multi-host group does not time them"
    size = cfg.num_layers * sum(a * b for a, b in layer_matrices(cfg)) + cfg.vocab_size * cfg.hidden_size
    if size < MIN_TIMED_INT8_BYTES:
        return (0, 0), f"converted dots: {size / 2**20:.1f} MiB of int8 weights, too few to time"
    form = "integer dots of split rows" if kernel is None else f"integer dots by {kernel}"
    key = _key(f"{form} per part, {FORM}", cfg, dtype, INTEGER_CANDIDATES)
    if key not in _chosen:
        saved = read_timings(cache_file)
        timings = saved.get(key)
        first = timings.get(str(INTEGER_CANDIDATES[0])) if isinstance(timings, dict) else None
        if not (isinstance(first, dict) and all(isinstance(first.get(part), dict) for part in PARTS)):
            start = time.perf_counter()
            try:
                timings = time_integer_dots(measure or DecodeDots(cfg, dtype, kernel).integer_timings)
            except Exception as e:  # noqa: BLE001 — converted dots, as without integer dots
                log.warning("could not time int8's integer dots here (%s): converted dots", e)
                return (0, 0), f"int8's integer dots could not be timed here ({type(e).__name__}: {e})"
            log.info("timed int8's integer and converted dots in %.1f s", time.perf_counter() - start)
            write_timings(cache_file, {**read_timings(cache_file), key: timings})
        _chosen[key] = tuple(most_integer_rows(timings, part) for part in PARTS)
    chosen = _chosen[key]
    said = ", ".join(f"{part} up to {rows} rows" if rows else f"{part} converted" for part, rows in zip(PARTS, chosen))
    return chosen, f"integer dots: {said}; a step's dots at {', '.join(map(str, INTEGER_CANDIDATES))} rows " \
                   f"measured here"


def time_integer_dots(measure) -> dict:
    """{rows: {part: timings}} at each candidate row count, of the parts not yet settled (a part is
    settled at the first count where its integer dots were clearly slower)."""
    timings: dict = {}
    for rows in INTEGER_CANDIDATES:
        parts = [part for part in PARTS if not any(_slower(t.get(part)) for t in timings.values())]
        if not parts:
            break
        timings[str(rows)] = measure(rows, parts)
    return timings


def most_integer_rows(timings: dict, part: str) -> int:
    """The most candidate rows at which `part`'s integer dots were clearly faster than converted
    ones, or tied with them after being clearly faster at fewer rows, before the first at which they
    were clearly slower (0: none). A tie past a win is noise about a crossover still ahead: stopping
    there sent a 64-row step through conversion that integer dots ran as fast (a 16-row choice of
    the layers beside 32 tied and 64 faster, on an AVX2 AMD EPYC)."""
    most = 0
    for rows in INTEGER_CANDIDATES:
        measured = timings.get(str(rows), {}).get(part)
        if measured is None or _slower(measured):
            break
        if most or clearly_faster(measured["integer"], measured["converted"]):
            most = rows
    return most


def _slower(measured: dict | None) -> bool:
    return measured is not None and clearly_faster(measured["converted"], measured["integer"])


def measure_decode_dots(cfg: ModelConfig, dtype: str, rows: int, integer_rows: tuple[int, int] = (0, 0),
                        reps: int = 3, kernel=None) -> dict[str, float]:
    """Milliseconds (best of `reps`) of the layers' matrices and the output layer on `rows` rows,
    in `dtype` and in int8 (integer dots up to `integer_rows` rows in each part, by `kernel`),
    scaled to the whole model."""
    dots = DecodeDots(cfg, dtype, kernel)
    return {"none": sum(dots.float_ms(rows, reps).values()),
            "int8": sum(dots.int8_ms(rows, integer_rows, reps).values())}


class DecodeDots:
    """Random weights of a decode step's dots in `cfg`'s shapes, at most `MAX_TIMED_BYTES` of the
    layers and of the output layer each, made in `dtype` or in int8 when first timed; times are
    per part (`PARTS`), scaled to the whole model. int8's integer dots are computed by `kernel`
    (None: XLA's)."""

    def __init__(self, cfg: ModelConfig, dtype: str, kernel=None):
        d, layer = cfg.hidden_size, layer_matrices(cfg)
        per_layer = sum(a * b for a, b in layer)
        most = max(1, min(cfg.num_layers, MAX_TIMED_BYTES // (4 * per_layer)))
        self.block = block_rows(cfg.vocab_size, d)
        vocab = max(self.block, min(cfg.vocab_size, MAX_TIMED_BYTES // (4 * d)) // self.block * self.block)
        rng = np.random.default_rng(0)
        self.stacked = [rng.standard_normal((most, *shape), np.float32) * 0.02 for shape in layer]
        self.head = rng.standard_normal((vocab, d), np.float32) * 0.02
        self.d, self.dtype, self.shares = d, dtype, dict(zip(PARTS, (most / cfg.num_layers, vocab / cfg.vocab_size)))
        self.kernel = kernel

    @functools.cached_property
    def float_parts(self):
        return dict(zip(PARTS, ([jnp.asarray(as_bits(w.astype(jnp.dtype(self.dtype)))) for w in self.stacked],
                                jnp.asarray(self.head, jnp.dtype(self.dtype)))))

    @functools.cached_property
    def int8_parts(self):
        layers = [quantize_on_device(jnp.asarray(w), 1, GROUPS["int8"]) for w in self.stacked]
        if self.kernel is not None:  # held as the engine holds them for the kernel (`layers_transposed`)
            layers = [tuple(a.swapaxes(1, 2) for a in matrix) for matrix in layers]
        return dict(zip(PARTS, (layers,
                                with_outliers(*quantize_on_device(jnp.asarray(self.head), 1, STORED["int8"]), 1,
                                              OUTLIERS["int8"]))))

    def float_ms(self, rows: int, reps: int, parts=PARTS) -> dict[str, float]:
        return self._ms(dict(zip(PARTS, (layer_dots, dense_transposed))), self.float_parts, rows, reps, parts)

    def int8_ms(self, rows: int, integer_rows: tuple[int, int], reps: int, parts=PARTS) -> dict[str, float]:
        blocks = self.block if jax.default_backend() == "cpu" else 0  # as resources.resolve_quantization
        kernel = self.kernel is not None  # the layers held and read as the engine does for it
        quant = Int8Dot("int8", self.dtype, blocks, GROUPS["int8"], OUTLIERS["int8"], integer_rows[0],
                        self.kernel if any(integer_rows) else None, integer_rows[1], kernel)
        fns = (lambda x, w: layer_dots(x, w, lambda x, qs, at=None: quant.dense(x, *qs, at), kernel, kernel),
               lambda x, w: quant.output_layer(x, *w[:2], True, *w[2:]))
        return self._ms(dict(zip(PARTS, fns)), self.int8_parts, rows, reps, parts)

    def integer_timings(self, rows: int, parts=PARTS, reps: int = 3) -> dict[str, dict[str, float]]:
        """{part: milliseconds of its int8 dots on `rows` rows as integer dots and as converted dots}."""
        integer, converted = self.int8_ms(rows, (rows, rows), reps, parts), self.int8_ms(rows, (0, 0), reps, parts)
        return {part: {"integer": integer[part], "converted": converted[part]} for part in parts}

    def _ms(self, fns: dict, weights: dict, rows: int, reps: int, parts) -> dict[str, float]:
        return {part: best_ms(compile_dots(fns[part], rows, self.d, weights[part]), weights[part], reps)
                / self.shares[part] for part in parts}


def _key(form: str, cfg: ModelConfig, *rest) -> str:
    """A measurement's key: its form, the model's shapes, `rest` (dtype, rows, ...) and the machine."""
    return " | ".join(map(str, (form, cpu_model(), platform.machine(), sorted(cpu_flags()), jax.default_backend(),
                                jax.__version__, os.environ.get("XLA_FLAGS", ""), _shapes(cfg), *rest)))


def _shapes(cfg: ModelConfig) -> tuple:
    return (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size)
