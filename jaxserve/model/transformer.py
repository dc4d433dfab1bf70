"""The decoder-only transformer shared by every family (Llama-style and Gemma 3).

`Transformer(tokens, kv_pool, meta, attend=...) -> (logits, kv_pool)` runs one ragged step: a flat
run of tokens from many sequences (see `paged_attention.StepMetadata`). The KV pool goes in and
comes out, so the runner can donate it and XLA updates it in place. The runner calls its two
halves apart: `hidden_states` (the layers) and `logits` (the output layer), so that the output
layer is compiled with the sampler, per row count, and the layers per token count.

The layers are one `DecoderLayer` whose parameters are stacked [L, ...], run by `lax.scan` with
the pool in the carry: XLA compiles one layer, not L (Gemma 3 270M's step compiled in a third of
the time), and what differs between layers (sliding window or not, RoPE base) comes in as
`LayerConstants` arrays. Each layer writes and reads its own slot of the pool's pages in place,
through its KV-cache group's block tables (`jaxserve.model.kv_groups`).
Legend: T tokens, R rows whose logits are wanted, L layers, P layers per page, D hidden, V vocab.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.config import ModelConfig
from jaxserve.model.layers import (MLP, Attention, LayerConstants, RMSNorm, dense, dense_transposed,
                                  rope_frequencies, rope_tables)
from jaxserve.model.paged_attention import Attend, StepMetadata
from jaxserve.model.quantization import STORED, Int8Dot, quantize_on_device, with_outliers
from jaxserve.model.weights import SCALES, check_weights, contracted_axis

KVPool = tuple  # (k [N, P, M, S, K], v [N, P, M, S, K])
MATRICES = ("qkv", "o_proj", "gate_up", "down_proj")  # a layer's (fused) matrices, [in, out]


class DecoderLayer(nnx.Module):
    """One decoder layer; built from stacked weights [L, ...], it holds every layer's parameters."""

    def __init__(self, cfg: ModelConfig, w: Mapping[str, jax.Array], quant: Int8Dot | None = None):
        eps = cfg.rms_norm_eps
        self.attn_norm = RMSNorm(w["attn_norm"], eps)
        self.attn = Attention(cfg, w, eps, quant)
        self.mlp_norm = RMSNorm(w["mlp_norm"], eps)
        self.mlp = MLP(w, cfg.activation, quant)
        # Gemma's sandwich norms: outputs of attention and MLP are normalized again.
        self.post_attn_norm = RMSNorm(w["post_attn_norm"], eps) if "post_attn_norm" in w else None
        self.post_mlp_norm = RMSNorm(w["post_mlp_norm"], eps) if "post_mlp_norm" in w else None

    def __call__(self, x, kv, layer: LayerConstants, meta: StepMetadata, attend: Attend, rope):
        h, kv = self.attn(self.attn_norm(x), kv, layer, meta, attend, rope)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.mlp(self.mlp_norm(x), layer.stack_index)
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return x + h, kv


class Transformer(nnx.Module):
    """Decoder built from canonical weights (see `jaxserve.model.weights`). Matrices are kept in
    `dtype`, or with `quant` in int8 with float16 scales, read in `dtype`
    (`jaxserve.model.quantization`); norms, biases and the activations between layers are
    float32."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, np.ndarray], dtype=jnp.float32,
                 source: str = "weights", quant: Int8Dot | None = None):
        check_weights(cfg, weights, source)
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype).name  # of the matrices, or of the activations int8 ones are read in
        self.quant = quant
        # Fusing and stacking run where the weights are: numpy arrays on the host, each result then
        # moved to the device once (op by op on the device, the load took seconds longer, most
        # of it after the constructor returned); jax.Arrays (a sharded restore) on their devices.
        xp = jnp if any(isinstance(w, jax.Array) for w in weights.values()) else np
        put = jax.device_put  # a transfer; jnp.asarray would compile a copy program per shape
        if quant is None and any(w.dtype == np.int8 for w in weights.values()):
            raise ValueError(f"{source}: int8 weights need quantization='int8' or 'w8a8'")
        stored = jnp.float32 if quant else dtype  # quantized from float32
        param = lambda a: None if a is None else nnx.Param(a)  # noqa: E731
        embed, embed_scales, embed_channels, embed_outliers = map(
            param, _matrix(weights, "embed", dtype, quant, xp, output_layer=cfg.tie_embeddings))
        self.embed = embed  # [V, D]
        self.embed_scales = embed_scales  # [V, D / group]
        self.embed_outlier_channels = embed_channels  # [k] int8's output layer: input channels kept in float
        self.embed_outliers = embed_outliers  # [V, k] their float32 weights
        lm_head, lm_head_scales, lm_head_channels, lm_head_outliers = map(param, (None,) * 4 if cfg.tie_embeddings
                                                                          else _matrix(weights, "lm_head", dtype, quant, xp))
        self.lm_head = lm_head  # [D, V]
        self.lm_head_scales = lm_head_scales  # [D / group, V]
        self.lm_head_outlier_channels = lm_head_channels  # [k]
        self.lm_head_outliers = lm_head_outliers  # [k, V]
        self.final_norm = RMSNorm(put(xp.asarray(weights["final_norm"], jnp.float32)), cfg.rms_norm_eps)
        per_layer = [_layer_weights(cfg, weights, i, stored, xp) for i in range(cfg.num_layers)]
        stacked = {name: xp.stack([w[name] for w in per_layer]) for name in per_layer[0]}
        for name in MATRICES if quant else ():  # [L, in, out], contracted along `in`
            if name + "_scale" not in stacked:  # not quantized by the loader
                stacked[name], stacked[name + "_scale"] = quantize_on_device(put(stacked[name]), 1, quant.group)
            _check_group(stacked[name].shape[1], stacked[name + "_scale"].shape[1], quant.group, quant, name)
            if quant.layers_transposed:  # [L, out, in] and [L, out, in / group]
                stacked[name], stacked[name + "_scale"] = (stacked[n].swapaxes(1, 2) for n in (name, name + "_scale"))
        self.layers = DecoderLayer(cfg, {name: put(as_bits(w)) for name, w in stacked.items()}, quant)

    def __call__(self, tokens, kv_pool: KVPool, meta: StepMetadata, *, attend: Attend, logits_indices=None):
        """tokens: [T] int32; logits_indices: [R] tokens whose logits to return (None: all).
        Returns (logits [R or T, V] float32, new kv_pool)."""
        x, kv_pool = self.hidden_states(tokens, kv_pool, meta, attend=attend, rows=logits_indices)
        return self.logits(x), kv_pool

    def hidden_states(self, tokens, kv_pool: KVPool, meta: StepMetadata, *, attend: Attend, rows=None):
        """The layers: tokens [T] int32 -> (final hidden states [R or T, D] float32 of the tokens
        `rows` [R] (None: all), new kv_pool)."""
        x = self.embed[...][tokens].astype(jnp.float32) if self.quant is None else self.quant.embedding(
            *_values(self.embed, self.embed_scales), tokens, *_values(self.embed_outlier_channels, self.embed_outliers))
        if self.cfg.embed_scale != 1.0:
            x = x * self.cfg.embed_scale
        # int8's CPU kernel reads each layer's matrices in their stacks: they stay whole through the scan
        in_place = _int8_matrix if self.quant is not None and self.quant.kernel is not None else nnx.Nothing
        graphdef, whole, stacked = nnx.split(self.layers, in_place, ...)
        rope = rope_tables(meta.positions, rope_frequencies(self.cfg))

        def layer_step(carry, xs):
            x, pool = carry
            params, constants = xs
            params = jax.tree.map(from_bits, params)
            return nnx.merge(graphdef, whole, params)(x, pool, constants, meta, attend, rope), None
        xs = (stacked, LayerConstants.stacked(self.cfg))
        (x, new_pool), _ = jax.lax.scan(layer_step, (x, tuple(kv_pool)), xs)
        return (x if rows is None else x[rows]), new_pool

    def logits(self, x):
        """The output layer: hidden states [R, D] float32 -> logits [R, V] float32."""
        x = self.final_norm(x)
        if self.quant is not None:
            tied = self.lm_head is None
            params = ((self.embed, self.embed_scales, self.embed_outlier_channels, self.embed_outliers) if tied else
                      (self.lm_head, self.lm_head_scales, self.lm_head_outlier_channels, self.lm_head_outliers))
            weights, scales, *outliers = _values(*params)
            logits = self.quant.output_layer(x, weights, scales, tied, *outliers)
        elif self.lm_head is None:
            logits = dense_transposed(x, self.embed[...])
        else:
            logits = dense(x, self.lm_head[...])
        if self.cfg.final_logit_softcap is not None:
            cap = self.cfg.final_logit_softcap
            logits = cap * jnp.tanh(logits / cap)
        return logits


def _matrix(weights: Mapping, name: str, dtype, quant: Int8Dot | None, xp, output_layer: bool = True):
    """(matrix, scales, outlier channels, their weights) on the device: (matrix in `dtype`, None,
    None, None); with `quant`, the int8 matrix and its scales as the loader gave them or quantized
    here, and for the output layer of a mode with `outliers`, laid out again by `with_outliers`."""
    w, axis = weights[name], contracted_axis(name)
    if quant is None:
        return jax.device_put(xp.asarray(w, dtype)), None, None, None
    group = STORED[quant.mode]  # as the loader quantizes, so that a model built here equals one loaded quantized
    if w.dtype == np.int8:
        q, scales = (jax.device_put(xp.asarray(a)) for a in (w, weights[name + SCALES]))
    else:
        q, scales = quantize_on_device(jax.device_put(xp.asarray(w, jnp.float32)), axis, group)
    _check_group(q.shape[axis], scales.shape[axis], group, quant, name)
    if quant.outliers and output_layer:
        return with_outliers(q, scales, axis, quant.outliers)
    return q, scales, None, None


def _int8_matrix(path, value) -> bool:
    """Whether a layer's state at `path` is one of its int8 matrices or their scales."""
    return str(path[-1]).removesuffix("_scale") in ("qkv", "out", "gate_up", "down")


def _values(*params):
    return tuple(None if p is None else p[...] for p in params)


def _check_group(size: int, groups: int, group: int | None, quant: Int8Dot, name: str) -> None:
    """Loaded int8 weights have the scales `quant` reads: one per `group` weights (None: per
    output channel). int8's layers are rounded per channel by the engine (`jaxserve.worker.calibration`)."""
    group = group if group and size % group == 0 else size
    if groups * group != size:
        raise ValueError(f"{name}: int8 weights with one scale per {size // groups} weights, but "
                         f"quantization={quant.mode!r} reads one per {group}")


# XLA:CPU slices a bfloat16 array through float32 and hoists the conversion of the whole stack out
# of the loop, so every step would convert all the layers' weights (and a bitcast of the stack at
# the start of the step is a copy). So stacked bfloat16 weights are kept as their bits (uint16):
# the scan slices integers, and each layer reinterprets its own slice.
def as_bits(x):
    if x.dtype != jnp.bfloat16:
        return x
    return x.view(np.uint16) if isinstance(x, np.ndarray) else jax.lax.bitcast_convert_type(x, jnp.uint16)


def from_bits(x):
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x


def _layer_weights(cfg: ModelConfig, weights: Mapping[str, np.ndarray], i: int, dtype, xp=jnp) -> dict:
    """One layer's weights, with q/k/v and gate/up fused into single matmuls.

    Columns are grouped so that any contiguous split of them is head-aligned, and tensor
    parallelism needs no reshuffling: qkv as [D, N, G + 2, K] (each kv head's G query heads, then
    its k and v), gate/up interleaved per MLP unit as [D, F, 2].
    """
    p = f"layers.{i}."
    get32 = lambda name: xp.asarray(weights[p + name], jnp.float32)
    if weights[p + "q_proj"].dtype == np.int8:  # quantized by the loader: the scales fuse as their weights
        w = _fused(cfg, lambda name: xp.asarray(weights[p + name]), xp)
        w |= {name + "_scale": s for name, s in _fused(cfg, lambda name: xp.asarray(weights[p + name + SCALES]), xp).items()}
    else:
        w = _fused(cfg, lambda name: xp.asarray(weights[p + name], dtype), xp)
    if p + "q_bias" in weights:
        w["qkv_bias"] = _group_heads(cfg, get32("q_bias"), get32("k_bias"), get32("v_bias"), xp)
    for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"):
        if p + name in weights:
            w[name] = get32(name)
    return w


def _fused(cfg: ModelConfig, get, xp) -> dict:
    """A layer's matrices `get(name)` [in, out] (or their scales), fused: qkv and gate/up."""
    gate_up = xp.stack([get("gate_proj"), get("up_proj")], axis=-1)  # [in, F, 2]
    return {"qkv": _group_heads(cfg, get("q_proj"), get("k_proj"), get("v_proj"), xp),
            "gate_up": gate_up.reshape(gate_up.shape[0], -1), "o_proj": get("o_proj"), "down_proj": get("down_proj")}


def _group_heads(cfg: ModelConfig, q, key, value, xp):
    """[..., H K], [..., N K], [..., N K] -> [..., N (G + 2) K]: each kv head's query heads, then its k and v."""
    n, k, lead = cfg.num_kv_heads, cfg.head_dim, q.shape[:-1]
    parts = [q.reshape(*lead, n, -1, k), key.reshape(*lead, n, 1, k), value.reshape(*lead, n, 1, k)]
    return xp.concatenate(parts, axis=-2).reshape(*lead, -1)
