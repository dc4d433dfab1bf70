"""The canonical weight names and shapes every loader produces, and the check that enforces them.

Loaders (Hugging Face safetensors, GGUF, Orbax) turn a checkpoint into a flat dict of numpy arrays
under these names, with every matrix stored as `[in, out]` so the model computes `x @ w`:

    embed                    [V, D]
    lm_head                  [D, V]        only when embeddings are not tied
    final_norm               [D]
    layers.{i}.attn_norm     [D]
    layers.{i}.q_proj        [D, H*K]      (q_bias [H*K], k_bias, v_bias when attention_bias)
    layers.{i}.k_proj        [D, N*K]
    layers.{i}.v_proj        [D, N*K]
    layers.{i}.o_proj        [H*K, D]
    layers.{i}.q_norm        [K]           only with qk_norm
    layers.{i}.k_norm        [K]           only with qk_norm
    layers.{i}.post_attn_norm [D]          only with sandwich_norms (Gemma)
    layers.{i}.mlp_norm      [D]
    layers.{i}.post_mlp_norm [D]           only with sandwich_norms (Gemma)
    layers.{i}.gate_proj     [D, F]
    layers.{i}.up_proj       [D, F]
    layers.{i}.down_proj     [F, D]

Legend: V vocab, D hidden, H query heads, N kv heads, K head dim, F MLP width.
RMSNorm weights are the plain multiplier (Gemma's `1 + w` already added).

A loader asked for int8 weights gives a matrix as int8 beside its float16 scales, `{name}.scales`:
the matrix's shape with the contracted axis (`CONTRACTED`: D of the embedding, `in` of the others)
divided by the weights per scale (`jaxserve.model.quantization`).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from jaxserve.model.config import ModelConfig


SCALES = ".scales"
MATRIX_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def contracted_axis(name: str) -> int | None:
    """The axis a dot contracts of weight `name`; None for a weight that is not a matrix."""
    if name == "embed":
        return 1  # the output layer of a tied model: logits = x @ embed.T
    return 0 if name == "lm_head" or name.rsplit(".", 1)[-1] in MATRIX_NAMES else None


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight name the model needs, with its shape."""
    d, f, k = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * k, cfg.num_kv_heads * k
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, d), "final_norm": (d,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attn_norm": (d,), p + "q_proj": (d, q), p + "k_proj": (d, kv), p + "v_proj": (d, kv),
            p + "o_proj": (q, d), p + "mlp_norm": (d,),
            p + "gate_proj": (d, f), p + "up_proj": (d, f), p + "down_proj": (f, d),
        }
        if cfg.attention_bias:
            shapes |= {p + "q_bias": (q,), p + "k_bias": (kv,), p + "v_bias": (kv,)}
        if cfg.qk_norm:
            shapes |= {p + "q_norm": (k,), p + "k_norm": (k,)}
        if cfg.sandwich_norms:
            shapes |= {p + "post_attn_norm": (d,), p + "post_mlp_norm": (d,)}
    return shapes


def check_weights(cfg: ModelConfig, weights: Mapping[str, np.ndarray], source: str) -> None:
    """Raises ValueError naming the first missing, unexpected or misshaped tensor."""
    expected = expected_shapes(cfg)
    for name in [n for n in weights if n.endswith(SCALES)]:
        _check_scales(name, weights, expected, source)
    unscaled = [n for n, w in weights.items() if w.dtype == np.int8 and n + SCALES not in weights]
    if unscaled:
        raise ValueError(f"{source}: int8 matrix {unscaled[0]!r} without its scales {unscaled[0] + SCALES!r}")
    weights = {name: w for name, w in weights.items() if not name.endswith(SCALES)}
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"{source}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise ValueError(f"{source}: unexpected tensor(s) {unexpected[:5]}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")


def _check_scales(name: str, weights: Mapping[str, np.ndarray], expected, source: str) -> None:
    """A matrix's scales: int8 beside them, the matrix's shape but along the contracted axis."""
    matrix = name.removesuffix(SCALES)
    axis = contracted_axis(matrix)
    if axis is None or matrix not in expected:
        raise ValueError(f"{source}: scales {name!r} belong to no matrix")
    if matrix not in weights or weights[matrix].dtype != np.int8:
        raise ValueError(f"{source}: scales {name!r} without the int8 matrix {matrix!r}")
    shape, stored = expected[matrix], tuple(weights[name].shape)
    groups = stored[axis] if len(stored) == len(shape) else 0
    if not groups or shape[axis] % groups or any(a != b for i, (a, b) in enumerate(zip(shape, stored)) if i != axis):
        raise ValueError(f"{source}: scales {name!r} have shape {stored}, which does not divide {shape} "
                         f"along axis {axis}")
