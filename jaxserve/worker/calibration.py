"""int8's layer matrices with one scale per output channel, rounded by GPTQ (Frantar et al., 2022)
against the inputs each matrix sees on a calibration text.

Rounded to the nearest, one scale per output channel moved Gemma 3 270M's next tokens too far
(95.6% top-1 agreement with bfloat16); a scale per 32 weights was accurate but no faster than
bfloat16 on XLA:CPU, which converts each group before the dot. GPTQ rounds one input row at a
time and spreads each row's error over the rows not yet rounded, weighted by how the inputs
co-vary (their Gram matrix X^T X), so that x @ w moves least on inputs like those: per channel
it agreed on 97.5% (docs/quantization.md).

The calibration text is two chapters of the Python Language Reference as CPython ships them
(`pydoc_data.topics`, the same words on every machine with this Python), not the chapter
`scripts/bench_quantization.py` scores. qwix has GPTQ (`qwix.contrib.gptq_core`) but unrolls a
Python loop per input row: 43 s to compile at 640 rows, 228 s at 2,048 on 2 cores. Here the rows
of a block run in a `fori_loop`, and the layers of one matrix kind in one `vmap`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pydoc_data.topics
from flax import nnx

from jaxserve.model.config import ModelConfig
from jaxserve.model.kv_groups import kv_groups
from jaxserve.model.layers import dense
from jaxserve.model.quantization import STORED, dequantize, quantize, stored_int8
from jaxserve.model.transformer import Transformer
from jaxserve.model.weights import SCALES, contracted_axis
from jaxserve.pallas_kernels.backend import attention_fn
from jaxserve.worker.kv_pool import allocate_kv_pool
from jaxserve.worker.step_batch import ScheduledSeq, StepBuckets, StepSeqs, build_step, table_metadata

log = logging.getLogger(__name__)

CHAPTERS = ("compound", "types")  # of pydoc_data.topics; bench_quantization scores "execmodel"
TOKENS = 1024  # of each chapter, or the model's context if shorter
DAMP = 0.01  # of the Gram matrix's mean diagonal added to it, as GPTQ does
BLOCK = 128  # input rows rounded before their error reaches the rows after them in one matmul
# A layer's dots in the order its forward pass runs them, and the matrices that read each input.
INPUTS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
# Part of the cached rounding's key: a change to how this file rounds never reads an old result.
SOURCE = Path(__file__).read_bytes()


_hidden_states = nnx.jit(lambda model, tokens, pool, meta: model.hidden_states(
    tokens, pool, meta, attend=attention_fn("reference")))  # compiled once per model and length


def prefill_hidden(model: Transformer, ids: list[int], page: int = 16) -> jax.Array:
    """The final hidden states [n, D] of one sequence `ids` run in one prefill (reference attention)."""
    n, groups = len(ids), kv_groups(model.cfg).num_groups
    width = -(-n // page)
    tables = 1 + np.arange(groups * width, dtype=np.int32).reshape(1, groups, width)
    step = build_step(StepSeqs.of([ScheduledSeq(0, 0, ids)]), 1, page, StepBuckets(max_tokens=n, max_seqs=1))
    meta = table_metadata(step.meta, tables, step.seq_slots, step.token_seq_slots, page)
    pool = allocate_kv_pool(model.cfg, 1 + groups * width, page, jnp.float32)
    hidden, _ = _hidden_states(model, jnp.asarray(step.tokens), pool, meta)
    return hidden[:n]


def calibration_ids(tokenizer, cfg: ModelConfig) -> list[list[int]]:
    """The calibration text's tokens, a sequence per chapter; without a tokenizer, as many random
    tokens (seeded), which round worse than text but still by the inputs the layers see."""
    length = min(TOKENS, cfg.max_position_embeddings)
    if tokenizer is None:
        rng = np.random.default_rng(0)
        return [rng.integers(0, cfg.vocab_size, length).tolist() for _ in CHAPTERS]
    return [tokenizer.encode(pydoc_data.topics.topics[name])[:length] for name in CHAPTERS]


@dataclasses.dataclass(eq=False)
class _GramRecorder:
    """Stands in for a float model's `quant` in its layers: each dot's input Gram matrix x^T x over
    the `tokens` real tokens goes to the host, in the order the layers run."""

    tokens: int
    grams: list = dataclasses.field(default_factory=list)

    def dense(self, x, w, scale):
        real = x[:self.tokens].astype(jnp.float32)
        jax.debug.callback(lambda g: self.grams.append(np.asarray(g, np.float64)), real.T @ real, ordered=True)
        return dense(x, w)


def input_grams(cfg: ModelConfig, weights: dict, sequences: list[list[int]]) -> list[list[np.ndarray]]:
    """Per layer, per entry of INPUTS, the Gram matrix of that dot's inputs [in, in] over
    `sequences`, divided by their tokens; the model runs in float32 on the values its int8 weights
    stand for (`stored_values`)."""
    floats = {name: w if contracted_axis(name) is None else stored_values(weights, name)
              for name, w in weights.items() if not name.endswith(SCALES)}
    model = Transformer(cfg, floats, jnp.float32)
    total = [[0.0] * len(INPUTS) for _ in range(cfg.num_layers)]
    for ids in sequences:
        recorder = _GramRecorder(len(ids))
        model.layers.attn.quant = model.layers.mlp.quant = recorder
        jax.block_until_ready(prefill_hidden(model, ids))
        jax.effects_barrier()
        if len(recorder.grams) != cfg.num_layers * len(INPUTS):
            raise RuntimeError(f"calibration saw {len(recorder.grams)} dots, not {cfg.num_layers * len(INPUTS)}")
        for i, gram in enumerate(recorder.grams):
            layer, kind = divmod(i, len(INPUTS))
            total[layer][kind] = total[layer][kind] + gram
    tokens = sum(len(ids) for ids in sequences)
    return [[g / tokens for g in layer] for layer in total]


@jax.jit
@jax.vmap
def gptq(w: jax.Array, gram: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Matrices w [L, in, out] (contracted along `in`) and their inputs' Gram matrices [L, in, in]
    -> int8 [L, in, out] with one float16 scale per output channel [L, 1, out]."""
    k = w.shape[0]
    scale = (jnp.max(jnp.abs(w), axis=0, keepdims=True) / 127).astype(jnp.float16)  # as stored
    scale = jnp.where(scale == 0, jnp.float16(1), scale)
    s = scale.astype(jnp.float32)[0]
    diag = jnp.diagonal(gram)
    dead = diag == 0  # an input that is always 0: its weights do not matter
    gram = jnp.where(jnp.diag(dead), 1.0, gram) + DAMP * jnp.mean(diag) * jnp.eye(k)
    w = jnp.where(dead[:, None], 0.0, w)
    order = jnp.argsort(-diag)  # the inputs of most weight first, while the most rows are left to take their error
    w, gram = w[order], gram[order][:, order]
    u = jnp.linalg.cholesky(jnp.linalg.inv(gram)).T  # upper: its row i weighs row i's error on the rows after it
    blocks = []
    for start in range(0, k, BLOCK):
        end = min(start + BLOCK, k)
        block_u = u[start:end, start:end]

        def row(i, carry):
            wb, qb, errors = carry
            q = jnp.clip(jnp.round(wb[i] / s), -127, 127)
            error = (wb[i] - q * s) / block_u[i, i]
            wb = wb - block_u[i][:, None] * error[None, :]  # rows after i (u is upper triangular)
            return wb, qb.at[i].set(q), errors.at[i].set(error)
        zeros = jnp.zeros((end - start, w.shape[1]), jnp.float32)
        _, qb, errors = jax.lax.fori_loop(0, end - start, row, (w[start:end], zeros, zeros))
        w = w.at[end:].add(-(u[start:end, end:].T @ errors))
        blocks.append(qb)
    return jnp.concatenate(blocks).astype(jnp.int8)[jnp.argsort(order)], scale


def rounded_layers(cfg: ModelConfig, weights: dict, tokenizer, cache_dir: str | None = None) -> dict:
    """`weights` with every layer matrix int8 with one scale per output channel, rounded by GPTQ
    from the values it stands for (`stored_values`); kept in `cache_dir` under a hash of the
    weights and one of how they are rounded (this file's code, the calibration tokens), so a later
    start reads it back and a changed rounding never reads an older one."""
    names = [f"layers.{i}.{m}" for i in range(cfg.num_layers) for kind in INPUTS for m in kind]
    if all(weights[n].dtype == np.int8 and weights[n + SCALES].shape[0] == 1 for n in names):
        return weights  # rounded already
    sequences = calibration_ids(tokenizer, cfg)
    path = cache_dir and os.path.join(cache_dir, f"int8_layers-{_fingerprints(cfg, weights, names, sequences)}.npz")
    if path and os.path.exists(path):
        with np.load(path, allow_pickle=False) as saved:
            return {**weights, **{name: saved[name] for name in saved.files}}
    start = time.perf_counter()
    log.info("int8: rounding the layers by GPTQ on %d calibration tokens (once: kept in %s)",
             sum(map(len, sequences)), cache_dir or "no cache")
    grams = input_grams(cfg, weights, sequences)
    out = dict(weights)
    for kind, matrices in enumerate(INPUTS):
        gram = jnp.asarray(np.stack([layer[kind] for layer in grams]), jnp.float32)
        for m in matrices:
            layer_names = [f"layers.{i}.{m}" for i in range(cfg.num_layers)]
            w = np.stack([stored_values(weights, n) for n in layer_names])
            q, scale = (np.asarray(a) for a in gptq(jnp.asarray(w), gram))
            for i, n in enumerate(layer_names):
                out[n], out[n + SCALES] = q[i], scale[i]
    log.info("int8: layers rounded in %.1f s", time.perf_counter() - start)
    if path:
        _save(path, {n: out[n] for name in names for n in (name, name + SCALES)})
    return out


def _save(path: str, layers: dict) -> None:
    """Writes the rounded layers to `path`, and removes the same weights' roundings by other code or
    calibration text, which nothing reads again."""
    folder, name = os.path.split(path)
    try:
        os.makedirs(folder, exist_ok=True)
        np.savez(path + ".tmp.npz", **layers)
        os.replace(path + ".tmp.npz", path)
    except OSError as e:  # a read-only cache only costs the rounding next time
        log.warning("int8 layers not cached: %s", e)
        return
    same_weights = name.rsplit("-", 1)[0] + "-"
    for entry in os.listdir(folder):
        if entry.startswith(same_weights) and entry.endswith(".npz") and ".tmp." not in entry and entry != name:
            try:
                os.remove(os.path.join(folder, entry))
            except OSError:
                pass  # another process removed it first


def stored_values(weights: dict, name: str) -> np.ndarray:
    """The float32 values matrix `name` stands for as the loader gives it for int8 (`stored_int8`:
    a float embedding rounded so first), so that float weights and the same weights loaded int8
    round alike."""
    w, axis = weights[name], contracted_axis(name)
    if w.dtype == np.int8:
        return dequantize(w, weights[name + SCALES], axis)
    return dequantize(*quantize(w, axis, STORED["int8"]), axis) if stored_int8(name, "int8") else \
        np.asarray(w, np.float32)


def _fingerprints(cfg: ModelConfig, weights: dict, names: list[str], sequences: list[list[int]]) -> str:
    """"<hash of the layers' weights>-<hash of how they are rounded>"."""
    digest = hashlib.sha256()
    for name in names:
        for key in (name, name + SCALES):
            if key in weights:
                digest.update(np.ascontiguousarray(weights[key]).view(np.uint8).data)
    rounding = hashlib.sha256(SOURCE + repr((cfg, sequences)).encode())
    return f"{digest.hexdigest()[:20]}-{rounding.hexdigest()[:12]}"
