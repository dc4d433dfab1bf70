"""Choice of attention implementation, and the one ragged-attention entry point of the engine.

The engine resolves `EngineConfig.attention_backend` once with `select_backend` ("auto" becomes
"pallas" on GPU/TPU and "reference" on CPU); the runner then calls `attention_fn(backend)` and
hands the result to the model, which calls it once per layer inside the jitted step with that
layer's pool and the step's metadata.
"""

from __future__ import annotations

import functools

import jax

from jaxserve.pallas_kernels.ragged_reference import ragged_paged_attention_reference

IMPLEMENTATIONS = ("pallas", "reference")  # EngineConfig's attention_backend: one of these or "auto"


def select_backend(name: str = "auto") -> str:
    """Resolve a backend name to "pallas" or "reference"; raises ValueError for unknown names."""
    if name not in ("auto", *IMPLEMENTATIONS):
        raise ValueError(f"unknown attention backend {name!r}; expected auto or one of {IMPLEMENTATIONS}")
    if name == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "reference"
    return name


def ragged_attention(q, k_pages, v_pages, kv_lens, block_tables, query_start, num_seqs, *, backend: str,
                     sm_scale: float | None = None, sliding_window=None, soft_cap: float | None = None,
                     interpret: bool | None = None, layer=None, decode_rows=None) -> jax.Array:
    """Ragged paged attention (contract: `ragged_reference`) by the chosen backend.

    "pallas" runs the TPU kernel on a TPU and the GPU (Triton-style) kernel elsewhere, in
    interpret mode on CPU (`interpret=None` decides by the default backend). `decode_rows`: what
    computes "reference"'s decode rows instead of jnp (the CPU kernel, `jaxserve.cpu_kernels`).
    """
    resolved = select_backend(backend)
    args = (q, k_pages, v_pages, kv_lens, block_tables, query_start, num_seqs)
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, layer=layer)
    if resolved == "reference":
        return ragged_paged_attention_reference(*args, **options, decode_rows=decode_rows)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if jax.default_backend() == "tpu" and not interpret:
        from jaxserve.pallas_kernels.tpu_ragged_paged_attention import ragged_paged_attention_tpu
        return ragged_paged_attention_tpu(*args, **options)
    from jaxserve.pallas_kernels.ragged_paged_attention import ragged_paged_attention
    return ragged_paged_attention(*args, interpret=interpret, **options)


def attention_fn(backend: str, decode_rows=None):
    """`attend(q, k_pool, v_pool, layer, meta, **options)` for the model: the step metadata unpacked
    into a ragged attention call by `backend` on layer `layer` of the stacked pool."""
    def attend(q, k_pool, v_pool, layer, meta, **options):
        return ragged_attention(q, k_pool, v_pool, meta.kv_lens, meta.block_tables, meta.query_start,
                                meta.num_seqs, backend=backend, layer=layer, decode_rows=decode_rows, **options)
    return functools.wraps(ragged_attention)(attend)
