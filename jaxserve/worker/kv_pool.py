"""The preallocated paged KV pool: K and V, each of shape [N, P, M, S, K]. A page holds the K/V of P
layers (a KV-cache group's layers, see `jaxserve.model.kv_groups`; every layer when the model has no
sliding window), and each layer indexes its own slot in place; kv heads lead, so a model-parallel
split of the heads stays one contiguous block per device.

P layers per page, N kv heads, M pages (page 0 is the null page), S page size, K head dim. A bfloat16 pool may be
stored as its bits (uint16): XLA:CPU scatters and converts bfloat16 arrays through float32 copies
of the whole pool, while integers are scattered in place; readers reinterpret what they gather.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.config import ModelConfig
from jaxserve.model.kv_groups import kv_groups


def page_bytes(cfg: ModelConfig, page_size: int, dtype, kv_heads: int | None = None) -> int:
    """Bytes one page takes across its P layers, K and V, for `kv_heads` heads (all of them by default)."""
    layers = kv_groups(cfg).layers_per_page
    heads = cfg.num_kv_heads if kv_heads is None else kv_heads
    return 2 * layers * heads * page_size * cfg.head_dim * np.dtype(dtype).itemsize


def storage_dtype(dtype, as_bits: bool):
    """The array dtype of a pool of `dtype`: uint16 for bfloat16 kept as bits."""
    return jnp.dtype(jnp.uint16) if as_bits and jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype)


def allocate_kv_pool(cfg: ModelConfig, num_pages: int, page_size: int, dtype, sharding=None) -> tuple:
    """Zeroed pool (k, v), each [N, P, M, S, K] of `dtype` (a storage dtype), placed with
    `sharding` if given."""
    shape = (cfg.num_kv_heads, kv_groups(cfg).layers_per_page, num_pages, page_size, cfg.head_dim)
    # GiBs of zeros: XLA:CPU writes them 3x slower from a program compiled without optimization
    # (XLA_FLAGS=--xla_backend_optimization_level=0) than with it, so the level is set here.
    options = {"xla_backend_optimization_level": 3} if jax.default_backend() == "cpu" else None
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding).lower().compile(compiler_options=options)
    return zeros(), zeros()
