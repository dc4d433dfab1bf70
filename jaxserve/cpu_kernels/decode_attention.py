"""Decode attention on a CPU through XLA's FFI: `decode_attention.cc` beside this file, compiled for
this machine at its first use and kept in the cache folder (`jaxserve.cpu_kernels.library`).

The jnp reference attention (`jaxserve.pallas_kernels.ragged_reference`) is the engine's attention
on a CPU; its decode rows, one query row per sequence, run there as small batched dots per block
of keys, which XLA:CPU computes at a seventh of the memory's speed (docs/kernels.md). The kernel
computes those rows as `_decode_rows` does, reading each sequence's keys and values once, in place
in the pool. Prompt chunks keep the jnp code. Where no C++ compiler is found, or the build fails,
`load` says so and the engine keeps jnp's decode rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cpu_kernels import library

TARGET = "jaxserve_decode_attention"
MULTIPLE = 16  # the head dims the kernel reads are multiples of this
_loaded: dict[str, tuple] = {}  # by folder: (the library's name, why), as this process loaded it


@dataclasses.dataclass(frozen=True)
class CpuDecodeAttention:
    """The kernel as the reference attention's `decode_rows` calls it. `library`: the built file's
    name, which a compiled program's key holds (a new build, a new program)."""

    library: str

    @staticmethod
    def fits(head_dim: int) -> bool:
        """Whether the kernel reads heads of `head_dim` values."""
        return head_dim % MULTIPLE == 0

    def __call__(self, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                 tables: jax.Array, *, scale: float, window, soft_cap: float | None, layer) -> jax.Array:
        """`_decode_rows`' contract: q [S, H, D], one row per sequence, against the stacked pool
        [N, Λ, M, P, D] (float32, bfloat16 or uint16 holding its bits) at `layer`; lengths [S] (0: no
        row); tables [S, W]; window an int32 scalar -> [S, H, D] float32."""
        call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
        return call(q.astype(jnp.float32), k_pages, v_pages, jnp.asarray(layer, jnp.int32), lengths, tables,
                    jnp.asarray(window, jnp.int32), scale=np.float32(scale), soft_cap=np.float32(soft_cap or 0.0))


def load(folder: str) -> tuple[CpuDecodeAttention | None, str]:
    """(the kernel, built for this machine into `folder` and registered with XLA, or None where it
    cannot be; why): `jaxserve.cpu_kernels.library.load`."""
    name, why = library.load(folder, "decode_attention", "JaxserveDecodeAttention", TARGET, _loaded)
    return ((CpuDecodeAttention(name), f"decode attention's CPU kernel {why}") if name
            else (None, f"no CPU kernel for decode attention here ({why})"))
