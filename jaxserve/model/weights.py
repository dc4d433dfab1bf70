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
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from jaxserve.model.config import ModelConfig


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
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"{source}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise ValueError(f"{source}: unexpected tensor(s) {unexpected[:5]}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")
