"""What `quantization="auto"` resolves to: float or int8 weights, whichever runs a decode step's dots
faster on this machine.

A batch-1 decode step reads every weight once: its time is the layers' four matrices and the output
layer at the smallest row bucket. Both forms are timed as the model runs them (`Int8Dot` for int8),
on at most `MAX_TIMED_BYTES` of each, scaled to the whole model; int8 is chosen where it is clearly
faster (10% and a millisecond, as in `dtype_plan`). w8a8 is never chosen: on Gemma 3 270M it agreed
with bfloat16 on 89% of a text's next tokens (docs/quantization.md).

The timings are kept in `$JAXSERVE_CACHE/quantization_plans.json`, keyed by the CPU, jax, the XLA
flags, the shapes and the dtype: measured once per machine and model.
"""

from __future__ import annotations

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
from jaxserve.worker.machine import cpu_flags, cpu_model, int8_integer_rows

log = logging.getLogger(__name__)
FORM = "int8 layers per channel (integer dots of split rows where the CPU has them), output layer with float channels"  # the int8 dots timed: a new form times again


def auto_quantization(cfg: ModelConfig, dtype: str, rows: int, cache_file: str, measure=None) -> tuple[str | None, str]:
    """("int8" or None, why) for a model of `cfg` in `dtype` decoding `rows` rows at the least;
    `measure(cfg, dtype, rows)` gives {"none": ms, "int8": ms} (default: `measure_decode_dots`).
    A measurement that fails leaves the weights float."""
    key = " | ".join(map(str, (FORM, cpu_model(), platform.machine(), sorted(cpu_flags()), jax.default_backend(),
                               jax.__version__, os.environ.get("XLA_FLAGS", ""), _shapes(cfg), dtype, rows)))
    saved = read_timings(cache_file)
    timings = saved.get(key)
    if not (isinstance(timings, dict) and all(isinstance(timings.get(k), (int, float)) for k in ("none", "int8"))):
        start = time.perf_counter()
        try:
            timings = (measure or measure_decode_dots)(cfg, dtype, rows)
        except Exception as e:  # noqa: BLE001 — auto never fails: float weights, as without it
            log.warning("could not time int8 dots here (%s): the weights stay %s", e, dtype)
            return None, f"auto: int8 dots could not be timed here ({type(e).__name__}: {e})"
        log.info("timed a decode step's dots in %s and int8 in %.1f s", dtype, time.perf_counter() - start)
        write_timings(cache_file, {**saved, key: timings})
    mode = "int8" if clearly_faster(timings["int8"], timings["none"]) else None
    return mode, (f"auto: a decode step's dots at {rows} row{'s' * (rows > 1)} measured here, "
                  f"{timings['none']:.1f} ms in {dtype}, {timings['int8']:.1f} ms in int8")


def measure_decode_dots(cfg: ModelConfig, dtype: str, rows: int, reps: int = 3) -> dict[str, float]:
    """Milliseconds (best of `reps`) of the layers' matrices and the output layer on `rows` rows,
    in `dtype` and in int8, scaled to the whole model."""
    d, layer = cfg.hidden_size, layer_matrices(cfg)
    per_layer = sum(a * b for a, b in layer)
    most = max(1, min(cfg.num_layers, MAX_TIMED_BYTES // (4 * per_layer)))
    block = block_rows(cfg.vocab_size, d)
    vocab = max(block, min(cfg.vocab_size, MAX_TIMED_BYTES // (4 * d)) // block * block)
    rng = np.random.default_rng(0)
    stacked = [rng.standard_normal((most, *shape), np.float32) * 0.02 for shape in layer]
    head = rng.standard_normal((vocab, d), np.float32) * 0.02
    quant = Int8Dot("int8", dtype, block if jax.default_backend() == "cpu" else 0, GROUPS["int8"], OUTLIERS["int8"],
                    int8_integer_rows())
    float_layers = [jnp.asarray(as_bits(w.astype(jnp.dtype(dtype)))) for w in stacked]
    int8_layers = [quantize_on_device(jnp.asarray(w), 1, quant.group) for w in stacked]
    int8_head = with_outliers(*quantize_on_device(jnp.asarray(head), 1, STORED["int8"]), 1, OUTLIERS["int8"])
    runs = {"none": [(layer_dots, float_layers), (dense_transposed, jnp.asarray(head, jnp.dtype(dtype)))],
            "int8": [(lambda x, w: layer_dots(x, w, lambda x, qs: quant.dense(x, *qs)), int8_layers),
                     (lambda x, w: quant.output_layer(x, *w[:2], True, *w[2:]), int8_head)]}
    shares = (most / cfg.num_layers, vocab / cfg.vocab_size)
    return {mode: sum(best_ms(compile_dots(fn, rows, d, w), w, reps) / share for (fn, w), share in zip(pairs, shares))
            for mode, pairs in runs.items()}


def _shapes(cfg: ModelConfig) -> tuple:
    return (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size)
