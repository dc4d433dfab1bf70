"""Pallas attention kernels over the paged KV pool, each beside its plain-jnp reference.

`backend.ragged_attention` is the one entry point the engine calls (through `attention_fn`); the
kernels import lazily, since the TPU one pulls in the TPU Pallas module.
"""

from jaxserve.pallas_kernels.backend import IMPLEMENTATIONS, attention_fn, ragged_attention, select_backend
from jaxserve.pallas_kernels.ragged_reference import ragged_paged_attention_reference

__all__ = ["IMPLEMENTATIONS", "attention_fn", "ragged_attention", "ragged_paged_attention_reference", "select_backend"]
