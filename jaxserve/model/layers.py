"""Building blocks of the decoder: RMSNorm, rotary embeddings, the gated MLP and attention.

Legend: T tokens (the step's flat token axis), D hidden, H query heads, N kv heads, G = H/N, K head dim,
F MLP width.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.config import ModelConfig, RopeScaling
from jaxserve.model.kv_groups import kv_groups
from jaxserve.model.paged_attention import NO_WINDOW, Attend, StepMetadata, for_group, write_kv
from jaxserve.model.quantization import Int8Dot


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w in float32. Reduced-precision weights take x cast to their dtype and accumulate in
    float32: XLA's fast form on every backend, while activations between dots stay float32 (a
    bfloat16 dot with a bfloat16 result, or with one row, is 5-10x slower on XLA:CPU)."""
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def dense_transposed(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w.T in float32, contracting w's last axis in place: a transposed bfloat16 operand makes
    XLA:CPU convert and copy the whole matrix (10x slower for a tied 262k-row embedding)."""
    return jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def project(x: jax.Array, w: jax.Array, scale: jax.Array | None, quant: Int8Dot | None, at=None) -> jax.Array:
    """x @ w in float32, w a float matrix or (with `quant`) an int8 one with its scales; or w the
    stack of every layer's int8 matrices [L, ...] and `at` this layer's place in it (int8's CPU kernel
    reads a layer's matrix in place: a slice would be copied out for it first)."""
    if quant is None:
        return dense(x, w)
    return quant.dense(x, w, scale) if w.ndim == 2 else quant.dense(x, w, scale, at)


def _scale(weights, name: str):
    """The scales of an int8 matrix as a parameter, or None for a float one."""
    return nnx.Param(weights[name + "_scale"]) if name + "_scale" in weights else None


def _value(param):
    return None if param is None else param[...]


class RMSNorm(nnx.Module):
    """x / rms(x) * w, computed in float32 (w already holds Gemma's `1 +`)."""

    def __init__(self, weight: jax.Array, eps: float):
        self.weight = nnx.Param(weight)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies [K/2] of rotary embeddings, with linear or Llama-3 scaling."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv.astype(np.float32)
    if scaling.kind == "linear":
        return (inv / scaling.factor).astype(np.float32)
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_tables(positions: jax.Array, inv_freqs) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [F, T, 1, K/2] float32 of the step's positions [T] for each of F frequency sets
    [F, K/2]. Computed once per step, outside the layers: inside, XLA recomputed them in every
    head's and every half's fusion (on XLA:CPU, cos and sin over every head, twice per layer)."""
    angles = positions.astype(jnp.float32)[None, :, None, None] * jnp.asarray(inv_freqs, jnp.float32)[:, None, None]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x: [T, heads, K]; cos, sin: [T, 1, K/2] float32 (`rope_tables`)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerConstants:
    """What one layer of a scan knows of itself (each field stacked [L, ...] for the scan)."""

    index: jax.Array  # int32: the layer's slot in a page of the KV pool
    stack_index: jax.Array  # int32: its place in the stack of layers
    group: jax.Array  # int32: its KV-cache group (whose block tables it reads)
    window: jax.Array  # int32: its sliding window, NO_WINDOW for a global layer
    rope: jax.Array  # int32: its set of RoPE frequencies in `rope_frequencies` (local and global layers differ)

    @classmethod
    def stacked(cls, cfg: ModelConfig) -> "LayerConstants":
        _, layer_sets = _rope_sets(cfg)
        groups = kv_groups(cfg)
        return cls(index=np.array(groups.layer_slot, np.int32), stack_index=np.arange(cfg.num_layers, dtype=np.int32),
                   group=np.array(groups.layer_group, np.int32),
                   window=np.array([NO_WINDOW if w is None else w for w in cfg.layer_windows], np.int32),
                   rope=np.array(layer_sets, np.int32))


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """The model's distinct sets of RoPE inverse frequencies [F, K/2] float32, indexed by
    `LayerConstants.rope`."""
    return np.stack([rope_inv_freq(cfg.head_dim, theta, cfg.rope_scaling if scaled else None)
                     for theta, scaled in _rope_sets(cfg)[0]]).astype(np.float32)


def _rope_sets(cfg: ModelConfig) -> tuple[list[tuple[float, bool]], list[int]]:
    """The model's distinct (RoPE base, whether rope_scaling applies) pairs, sorted, and each
    layer's index among them: sliding-window layers are unscaled."""
    per_layer = [(theta, window is None and cfg.rope_scaling is not None)
                 for theta, window in zip(cfg.layer_rope_thetas, cfg.layer_windows)]
    distinct = sorted(set(per_layer))
    return distinct, [distinct.index(key) for key in per_layer]


class MLP(nnx.Module):
    """Gated MLP with gate and up fused into one matmul: down(act(x W_g) * (x W_u))."""

    def __init__(self, weights: dict[str, jax.Array], activation: str, quant: Int8Dot | None = None):
        self.gate_up = nnx.Param(weights["gate_up"])  # [D, F 2]: gate and up interleaved per unit
        self.down = nnx.Param(weights["down_proj"])  # [F, D]
        self.gate_up_scale, self.down_scale = _scale(weights, "gate_up"), _scale(weights, "down_proj")
        self.activation = activation
        self.quant = quant

    def __call__(self, x: jax.Array, at=None) -> jax.Array:
        """`at`: the layer's place in the stack, where its matrices are read in their stacks (`project`)."""
        both = project(x, self.gate_up[...], _value(self.gate_up_scale), self.quant, at)
        both = both.reshape(*x.shape[:-1], -1, 2)  # [..., F, 2]
        gate, up = both[..., 0], both[..., 1]
        if self.activation == "silu":
            gate = jax.nn.silu(gate)
        else:
            gate = jax.nn.gelu(gate, approximate=True)
        return project(gate * up, self.down[...], _value(self.down_scale), self.quant, at)


class Attention(nnx.Module):
    """Grouped-query attention that writes its K/V into the paged pool, then attends over each
    token's own sequence through `attend` (decode tokens and prompt chunks alike). What differs
    between layers (window, RoPE frequencies, the pool slice) comes in as arrays, so one traced
    layer serves every layer of a scan."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, jax.Array], norm_eps: float,
                 quant: Int8Dot | None = None):
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = nnx.Param(weights["qkv"])  # [D, N (G + 2) K], grouped per kv head
        self.qkv_bias = nnx.Param(weights["qkv_bias"]) if "qkv_bias" in weights else None
        self.out = nnx.Param(weights["o_proj"])  # [H K, D]
        self.qkv_scale, self.out_scale = _scale(weights, "qkv"), _scale(weights, "o_proj")
        self.quant = quant
        self.q_norm = RMSNorm(weights["q_norm"], norm_eps) if "q_norm" in weights else None
        self.k_norm = RMSNorm(weights["k_norm"], norm_eps) if "k_norm" in weights else None
        self.scale = cfg.scale
        self.soft_cap = cfg.attn_logit_softcap

    def __call__(self, x, kv, layer: LayerConstants, meta: StepMetadata, attend: Attend, rope):
        """x: [T, D]; kv: (k [N, P, M, S, K], v); rope: the step's `rope_tables`. Returns ([T, D], kv)."""
        t = x.shape[0]
        h, n, k = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = project(x, self.qkv[...], _value(self.qkv_scale), self.quant, layer.stack_index)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias[...]
        qkv = qkv.reshape(t, n, h // n + 2, k)  # per kv head: its query heads, then k, then v
        q = qkv[..., :-2, :].reshape(t, h, k)
        key, value = qkv[..., -2, :], qkv[..., -1, :]  # [T, N, K]
        if self.q_norm is not None:
            q, key = self.q_norm(q), self.k_norm(key)
        cos, sin = (jax.lax.dynamic_index_in_dim(table, layer.rope, keepdims=False) for table in rope)
        q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
        meta = for_group(meta, layer.group)
        k_pool, v_pool = write_kv(kv, key, value, meta.slot_mapping, layer.index)
        out = attend(q, k_pool, v_pool, layer.index, meta, sm_scale=self.scale, sliding_window=layer.window,
                     soft_cap=self.soft_cap)
        return (project(out.reshape(t, h * k), self.out[...], _value(self.out_scale), self.quant, layer.stack_index),
                (k_pool, v_pool))
