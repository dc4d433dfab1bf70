"""int8's integer dots on a CPU through XLA's FFI: `int8_dot.cc` beside this file, compiled for
this machine at its first use and kept in the cache folder (`jaxserve.cpu_kernels.library`).

XLA:CPU converts a whole int8 operand before a float dot, and runs its own integer dot of Gemma 3's
output layer at a third of the memory's speed (docs/quantization.md); Pallas runs on a CPU only
interpreted. The kernel computes what `Int8Dot`'s integer dots of split rows compute
(`jaxserve.model.quantization.split_rows`), reading each weight once for all the rows. Where no
C++ compiler is found, or the build fails, `load` says so and the engine keeps XLA's dots.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.cpu_kernels import library

TARGET = "jaxserve_int8_dot"
MULTIPLE = 16  # K and N of a matrix the kernel reads are multiples of this
_loaded: dict[str, tuple] = {}  # by folder: (the library's name, why), as this process loaded it


@dataclasses.dataclass(frozen=True)
class CpuInt8Dot:
    """The kernel as `Int8Dot` calls it. `library`: the built file's name, which a compiled
    program's key holds (a new build, a new program)."""

    library: str

    @staticmethod
    def fits(k: int, n: int) -> bool:
        """Whether the kernel reads a matrix contracting `k` into `n` outputs."""
        return k % MULTIPLE == 0 and n % MULTIPLE == 0

    def __call__(self, x: jax.Array, w: jax.Array, scale: jax.Array, transposed: bool,
                 index: jax.Array | int = 0) -> jax.Array:
        """x [R, K] float32 with int8 w ([N, K] if `transposed`, else [K, N]) and its float scales,
        one per output channel (N of them, any shape): [R, N] float32, as `Int8Dot`'s integer dot
        of split rows computes it. w may be a stack of such matrices [L, ...], its scales [L, ...]
        (N a matrix): then `index` picks one, and no slice of the stack is copied out for the call."""
        n = w.shape[-2] if transposed else w.shape[-1]
        call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
        return call(x.astype(jnp.float32), w, scale.astype(jnp.float32).reshape(*w.shape[:-2], n),
                    jnp.asarray(index, jnp.int32), transposed=transposed)


def load(folder: str) -> tuple[CpuInt8Dot | None, str]:
    """(the kernel, built for this machine into `folder` and registered with XLA, or None where it
    cannot be; why): `jaxserve.cpu_kernels.library.load`."""
    name, why = library.load(folder, "int8_dot", "JaxserveInt8Dot", TARGET, _loaded)
    return (CpuInt8Dot(name), f"int8's CPU kernel {why}") if name else (None, f"no CPU kernel for int8 here ({why})")
