"""Quantized weights: int8 matrices with float16 scales, and the dots that read them.

    int8   weight-only. The embedding and output layer are loaded and cached with one scale per
           32 weights along the contracted axis (GGUF's Q8_0 block); the engine rounds the layers'
           matrices with one scale per output channel, by GPTQ on a calibration text
           (`jaxserve.worker.calibration`), from the checkpoint's values: rounded
           to the nearest, one scale per channel agreed with bfloat16 on 95.6% of a text's next
           tokens on Gemma 3 270M, a scale per 32 weights on 98.5% but no faster than bfloat16 on
           XLA:CPU (docs/quantization.md). A model built here from float weights rounds them to
           the nearest. Each dot converts the int8 matrix to the activations' dtype; a scale per
           channel multiplies the dot's output. XLA:GPU and
           TPU fuse that into the dot. XLA:CPU does not: it converts the whole operand first, so
           the output layer, too large for any cache, is read in blocks of rows
           (`Int8Dot.block_rows`), each converted while it is in cache; the layers' matrices are
           converted one layer at a time inside the scan (Gemma 3's largest, gate/up, is 2.6M
           weights).
           The output layer (Gemma 3's tied embedding, 63% of its weights) is laid out apart as
           the model builds (`with_outliers`): one scale per output channel, applied to the
           logits rather than to each weight, and its `OUTLIERS` input channels of largest
           magnitude kept in float32 beside it, which one scale per channel would round too
           coarsely (docs/quantization.md).
    w8a8   int8 weights with one scale per output channel, and int8 activations quantized per
           token before each dot: an integer dot with int32 accumulation, where the hardware has
           int8 dot instructions (AVX-512 VNNI, AMX-INT8, GPU and TPU int8 units). No weight is
           converted.

Measured on an AMD EPYC with AVX-512 BF16 and VNNI, Gemma 3 270M's output layer (262,144 x 640)
at two rows: bfloat16 18-19 ms; int8 converted whole 223 ms; int8 in 4,096-row blocks 20 ms, 13.7
ms with one scale per channel (applied to the output, not to each weight); w8a8 12 ms (at one row
210 ms: XLA:CPU's one-row integer dot is as slow as its one-row bfloat16 one).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.weights import SCALES, contracted_axis

GROUP = 32  # int8's stored weights per scale along the contracted axis (GGUF's Q8_0 block)
STORED = {"int8": GROUP, "w8a8": None}  # weights per scale as each mode is loaded and cached (None: per output channel)
GROUPS = {"int8": None, "w8a8": None}  # weights per scale of the layers' dots
OUTLIERS = {"int8": 8, "w8a8": 0}  # input channels of the output layer each mode keeps in float
TILE_ELEMENTS = 1 << 22  # a block of the output layer converted at a time: 8 MiB in bfloat16, in cache


def quantize(w, axis: int, group: int | None = None, xp=np):
    """(int8 weights, float16 scales) of a matrix contracted along `axis`: symmetric, one scale
    per `group` consecutive weights along that axis and per index of the others (None: one per
    output channel). The scales have w's shape with that axis divided by the group, so that they
    shard like the weights. `xp`: numpy on the host, jax.numpy for arrays on their devices."""
    w = xp.asarray(w, np.float32)
    k = w.shape[axis]
    group = group if group and k % group == 0 else k
    shape = (*w.shape[:axis], k // group, group, *w.shape[axis + 1:])
    grouped = w.reshape(shape)
    scale = (xp.max(xp.abs(grouped), axis=axis + 1) / 127).astype(np.float16)  # as stored
    scale = xp.where(scale == 0, np.float16(1), scale)  # an all-zero group (or one under float16's range)
    q = xp.clip(xp.round(grouped / xp.expand_dims(scale.astype(np.float32), axis + 1)), -127, 127)
    return q.astype(np.int8).reshape(w.shape), scale


@functools.partial(jax.jit, static_argnums=(1, 2))
def quantize_on_device(w: jax.Array, axis: int, group: int | None):
    """`quantize` compiled, where the weights are: the same bits, and for Gemma 3's embedding 0.6 s
    against numpy's 9.6 s on 2 cores."""
    return quantize(w, axis, group, jnp)


def stored_int8(name: str, mode: str) -> bool:
    """Whether a loader stores matrix `name` as int8 for `mode`: w8a8 every matrix; int8 the
    embedding and output layer, its layers staying float32 for the engine to round by GPTQ
    (`jaxserve.worker.calibration`), from the checkpoint's own values."""
    return mode == "w8a8" or name in ("embed", "lm_head")


def quantize_matrices(weights: dict, mode: str) -> dict:
    """Canonical weights with the float matrices `mode` stores as int8 (`stored_int8`) beside their
    scales (`jaxserve.model.weights`), one per `STORED[mode]` weights; matrices already int8 are kept."""
    out = dict(weights)
    for name, w in weights.items():
        axis = contracted_axis(name)
        if axis is not None and w.dtype != np.int8 and stored_int8(name, mode):
            q, scale = quantize_on_device(jax.device_put(np.asarray(w, np.float32)), axis, STORED[mode])
            out[name], out[name + SCALES] = np.asarray(q), np.asarray(scale)
    return out


@functools.partial(jax.jit, static_argnums=(2, 3))
def with_outliers(q: jax.Array, scale: jax.Array, axis: int, k: int):
    """An int8 output layer (any scales) laid out as `Int8Dot.output_layer` reads it: (int8 with
    one scale per output channel, those scales, the `k` input channels of largest magnitude [k]
    int32, their float32 weights [V, k] or [k, V]). The int8 values of those channels are 0."""
    w = dequantize(q, scale, axis, jnp)
    channels = jnp.sort(jax.lax.top_k(jnp.max(jnp.abs(w), axis=1 - axis), k)[1]).astype(jnp.int32)
    is_kept = jnp.zeros(w.shape[axis], bool).at[channels].set(True)
    rest = jnp.where(jnp.expand_dims(is_kept, 1 - axis), 0.0, w)
    return (*quantize(rest, axis, None, jnp), channels, jnp.take(w, channels, axis=axis))


def dequantize(q, scale, axis: int, xp=np):
    """The float32 weights an int8 matrix stands for: numpy for tests and references, jax.numpy
    inside programs."""
    q, scale = xp.asarray(q, np.float32), xp.asarray(scale, np.float32)
    groups = scale.shape[axis]
    shape = (*q.shape[:axis], groups, q.shape[axis] // groups, *q.shape[axis + 1:])
    return (q.reshape(shape) * xp.expand_dims(scale, axis + 1)).reshape(q.shape)


def split_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Activations [R, K] rounded to 15 bits per row, as int8 [2R, K]: every row's high 8 bits, then
    its low 7 (x ~ scale (128 high + low)); and the float32 scales [R, 1]. One integer dot of the
    2R rows reads the weights once. Fixed point per row: finer than bfloat16's 8-bit mantissa for
    values above 1/128 of the row's largest, coarser below (Gemma 3 270M's top-1 agreement with
    bfloat16 on a text: 98.00%, 98.10% with the same weights' converted dots, docs/quantization.md)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / (127 * 128)
    scale = jnp.where(scale == 0, 1.0, scale)
    value = jnp.round(x / scale)  # |value| <= 127 * 128
    high = jnp.round(value / 128)
    return jnp.concatenate([high, value - 128 * high]).astype(jnp.int8), scale


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Activations [..., K] to int8 with one float32 scale a row [..., 1] (w8a8)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127
    scale = jnp.where(scale == 0, 1.0, scale)
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale


@dataclasses.dataclass(frozen=True)
class Int8Dot:
    """How a model's dots read int8 weights: `mode` ("int8" or "w8a8"), the dtype int8 weights are
    converted to (the activations' dtype), the weights per scale along the contracted axis
    (`group`; None: one scale per output channel, as w8a8's integer dots need), for the output
    layer the rows of a block (0: the whole matrix at once, where XLA fuses the conversion, and
    under a mesh) and its input channels kept in float (`outliers`). `integer_rows`: int8's dots of
    at most that many rows as integer dots of the activations split in two int8 rows each
    (`split_rows`; on a CPU as many as measured faster there, `quantization_plan.integer_rows`,
    as XLA:CPU converts a whole int8 operand before a float dot; 0: none); the output layer's up
    to `output_integer_rows` (None: as the layers'). `kernel`: a CPU kernel
    computing those integer dots (`jaxserve.cpu_kernels.int8_dot`, injected: the model imports no
    kernel), called for the matrices it `fits`; None: XLA's integer dot. `layers_transposed`: the
    layers' matrices are held [out, in] with their scales [out, in / group], as a tied embedding
    is, instead of [in, out] and [in / group, out] (the kernel reads a few rows' dots of Gemma 3's
    layers 1.3-1.5x faster so: each output one contiguous run of weights)."""

    mode: str
    compute_dtype: str
    block_rows: int = 0
    group: int | None = GROUP
    outliers: int = 0
    integer_rows: int = 0
    kernel: Callable | None = None
    output_integer_rows: int | None = None
    layers_transposed: bool = False

    def __post_init__(self):
        if self.mode == "w8a8" and self.group is not None:
            raise ValueError("w8a8's integer dots take one weight scale per output channel (group=None)")
        if self.output_integer_rows is None:
            object.__setattr__(self, "output_integer_rows", self.integer_rows)
        integer = max(self.integer_rows, self.output_integer_rows)
        if integer and (self.mode != "int8" or self.group is not None):
            raise ValueError("int8's integer dots take one weight scale per output channel (group=None)")
        if self.kernel is not None and not integer:
            raise ValueError("a kernel computes integer dots: it needs integer_rows")

    def describe(self) -> str:
        scales = "one per output channel" if self.group is None else f"one per {self.group} weights of a dot's inputs"
        kernel = " (a CPU kernel)" if self.kernel is not None else ""
        rows = (f"{self.integer_rows} rows" if self.integer_rows == self.output_integer_rows else
                f"{self.integer_rows} rows in the layers and {self.output_integer_rows} in the output layer")
        how = (f"int8, up to {rows} integer dots{kernel} of the activations rounded to 15 "
               f"bits, int32 sums, else read in {self.compute_dtype}" if self.integer_rows or self.output_integer_rows
               else f"int8, read in {self.compute_dtype}" if self.mode == "int8"
               else "w8a8: int8 activations (one scale a token), int32 sums")
        scales += ", the layers rounded by GPTQ" if self.mode == "int8" and self.group is None else ""
        outliers = (f", the output layer one per output channel with its {self.outliers} largest input "
                    f"channels in float32" if self.outliers else "")
        blocks = f", in blocks of {self.block_rows} rows" if self.block_rows else ""
        held = ", the layers held [out, in]" if self.layers_transposed else ""
        return f"{how}, float16 scales {scales}{outliers}{blocks}{held}"

    def dense(self, x: jax.Array, q: jax.Array, scale: jax.Array, at: jax.Array | None = None) -> jax.Array:
        """x [..., K] @ w [K, N] in float32, w = dequantize(q, scale, axis=0) (q [N, K] and
        dequantized along axis 1 with `layers_transposed`); or w the matrix `at` of a stack q
        [L, ...] (its scales [L, ...]), which the kernel reads in place."""
        axis = 1 if self.layers_transposed else 0
        return self._dot(x, q, scale, axis, (((x.ndim - 1,), (axis,)), ((), ())),
                         self._integer_at(x, self.integer_rows), at)

    def output_layer(self, x: jax.Array, q: jax.Array, scale: jax.Array, tied: bool,
                     channels: jax.Array | None = None, kept: jax.Array | None = None) -> jax.Array:
        """The logits [R, V] in float32 of x [R, D]: x @ w.T for a tied embedding w [V, D], x @ w
        for an output layer w [D, V] (w = dequantize(q, scale) along D), plus, with `outliers`,
        the float32 weights `kept` of the input `channels` (`with_outliers`)."""
        vocab, contracted = (0, 1) if tied else (1, 0)
        dims = (((1,), (contracted,)), ((), ()))
        outliers = None if channels is None else \
            jax.lax.dot_general(x[:, channels], kept, dims, preferred_element_type=jnp.float32)  # int8 holds 0 there
        n, rows = q.shape[vocab], self.block_rows
        integer = self._integer_at(x, self.output_integer_rows)
        if self.mode == "w8a8" or integer or not rows or rows >= n:  # integer dots read int8 as it is
            logits = self._dot(x, q, scale, contracted, dims, integer)
        else:
            def block(b):  # one block of the vocabulary, converted while it is in cache
                part = (jax.lax.dynamic_slice_in_dim(a, b * rows, rows, vocab) for a in (q, scale))
                return self._dot(x, *part, contracted, dims, False)
            out = jax.lax.map(block, jnp.arange(n // rows))  # [blocks, R, rows]
            logits = out.transpose(1, 0, 2).reshape(x.shape[0], n)
        return logits if outliers is None else logits + outliers

    def embedding(self, q: jax.Array, scale: jax.Array, tokens: jax.Array,
                  channels: jax.Array | None = None, kept: jax.Array | None = None) -> jax.Array:
        """The float32 rows [T, D] of the tokens in an int8 embedding [V, D] (with `outliers`, the
        float32 weights `kept` [V, k] of its input `channels` in their places)."""
        rows, scales = q[tokens].astype(jnp.float32), scale[tokens].astype(jnp.float32)  # [T, D], [T, G]
        t, d = rows.shape
        rows = (rows.reshape(t, scales.shape[1], -1) * scales[..., None]).reshape(t, d)
        return rows if channels is None else rows.at[:, channels].set(kept[tokens])

    @staticmethod
    def _integer_at(x: jax.Array, most_rows: int) -> bool:
        return np.prod(x.shape[:-1]) <= most_rows

    def _dot(self, x, q, scale, axis: int, dims, integer: bool, at=None):
        """x contracted with q along q's `axis` (dims: dot_general's), scaled; an integer dot of
        split rows if `integer`. With `at`, q and scale are stacks and the matrix is their `at`."""
        flat, matrix = x.reshape(-1, x.shape[-1]), q.shape[-2:]
        if integer and self.kernel is not None and self.kernel.fits(matrix[axis], matrix[1 - axis]):
            return self.kernel(flat, q, scale, axis == 1, 0 if at is None else at).reshape(*x.shape[:-1], -1)
        if at is not None:
            q, scale = q[at], scale[at]
        per_channel = scale.shape[axis] == 1  # the scale applies to the output columns
        out_scale = jnp.squeeze(scale, axis).astype(jnp.float32) if per_channel else None
        if self.mode == "w8a8":
            xq, xs = quantize_rows(x)
            acc = jax.lax.dot_general(xq, q, dims, preferred_element_type=jnp.int32)
            return acc.astype(jnp.float32) * xs * out_scale
        if integer:
            xq, xs = split_rows(flat)
            acc = jax.lax.dot_general(xq, q, (((1,), dims[0][1]), ((), ())), preferred_element_type=jnp.int32)
            acc, rows = acc.astype(jnp.float32), xs.shape[0]  # summed in float32: 128 high would overflow int32
            return ((128 * acc[:rows] + acc[rows:]) * xs * out_scale).reshape(*x.shape[:-1], -1)
        dtype = jnp.dtype(self.compute_dtype)
        if per_channel:
            w = q.astype(dtype)
        else:  # each group of weights along the contracted axis times its scale
            w = dequantize(q, scale, axis, jnp).astype(dtype)
        out = jax.lax.dot_general(x.astype(dtype), w, dims, preferred_element_type=jnp.float32)
        return out if out_scale is None else out * out_scale


def block_rows(n: int, k: int) -> int:
    """Rows of an output-layer block on a CPU: the largest divisor of n whose block [rows, k]
    holds at most TILE_ELEMENTS (4,096 for Gemma 3's 262,144 x 640)."""
    limit = max(1, TILE_ELEMENTS // k)
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0) if n > limit else n
