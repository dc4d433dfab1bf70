"""Pallas attention kernels over the paged KV pool, each beside its plain-jnp reference.

`backend.decode_attention` is the one entry point the engine calls; the kernels and references
are exported for tests and benchmarks. The TPU-style kernel lives in `tpu_paged_attention` and is
imported lazily (it pulls in the TPU Pallas module).
"""

from jaxserve.pallas_kernels.backend import BACKENDS, decode_attention, select_backend
from jaxserve.pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from jaxserve.pallas_kernels.prefill_attention import (
    prefill_attention, prefill_attention_reference)

__all__ = [
    "BACKENDS",
    "decode_attention",
    "paged_attention",
    "paged_attention_reference",
    "prefill_attention",
    "prefill_attention_reference",
    "select_backend",
]
