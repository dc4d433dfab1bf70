"""Choice of attention implementation, and the single decode-attention entry point of the engine.

The runner resolves `EngineConfig.attention_backend` once with `select_backend` ("auto" becomes
"pallas" on GPU/TPU and "reference" on CPU) and passes the result to `decode_attention` inside its
jitted decode step, once per layer, with that layer's KV pool `[K, N, P, D]`. `backend` must be a
static (hashable Python) value under jit.
"""

from __future__ import annotations

import jax

from jaxserve.pallas_kernels.paged_attention import paged_attention, paged_attention_reference

BACKENDS = ("auto", "pallas", "reference")


def select_backend(name: str = "auto") -> str:
    """Resolve a backend name to "pallas" or "reference"; raises ValueError for unknown names."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKENDS}")
    if name == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "reference"
    return name


def decode_attention(
    q: jax.Array,  # [S, H, D]
    k_pages: jax.Array,  # [K, N, P, D]
    v_pages: jax.Array,  # [K, N, P, D]
    block_tables: jax.Array,  # [S, T] int32
    lengths: jax.Array,  # [S] int32, tokens valid including the current one
    *,
    backend: str,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
) -> jax.Array:  # [S, H, D]
    """Decode attention for one query token per slot, by the chosen backend.

    "pallas" runs the TPU-style kernel on TPU and the GPU (Triton-style) kernel elsewhere
    (with `interpret=True` on CPU); "reference" is the plain XLA gather. "auto" is resolved here
    too. Raises ValueError for unknown backend names.
    """
    resolved = select_backend(backend)
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if resolved == "reference":
        return paged_attention_reference(q, k_pages, v_pages, block_tables, lengths, **kwargs)
    if jax.default_backend() == "tpu" and not interpret:
        from jaxserve.pallas_kernels.tpu_paged_attention import paged_attention_tpu
        return paged_attention_tpu(q, k_pages, v_pages, block_tables, lengths, **kwargs)
    return paged_attention(q, k_pages, v_pages, block_tables, lengths, interpret=interpret,
                           **kwargs)
