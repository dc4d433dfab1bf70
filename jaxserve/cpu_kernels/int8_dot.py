"""int8's integer dots on a CPU through XLA's FFI: `int8_dot.cc` beside this file, compiled for
this machine (`-march=native`) at its first use and kept in the cache folder.

XLA:CPU converts a whole int8 operand before a float dot, and runs its own integer dot of Gemma 3's
output layer at a third of the memory's speed (docs/quantization.md); Pallas runs on a CPU only
interpreted. The kernel computes what `Int8Dot`'s integer dots of split rows compute
(`jaxserve.model.quantization.split_rows`), reading each weight once for all the rows. Where no
C++ compiler is found, or the build fails, `load` says so and the engine keeps XLA's dots.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "int8_dot.cc")
TARGET = "jaxserve_int8_dot"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
MULTIPLE = 16  # K and N of a matrix the kernel reads are multiples of this
_loaded: dict[str, tuple] = {}  # by folder: (the kernel, why not), as `load` returned it in this process


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
    """(the kernel, built for this machine into `folder` (once; later processes read it back) and
    registered with XLA, or None where it cannot be: no compiler, a failed build; why). A process
    registers one build: a later folder gets the kernel already registered."""
    if folder in _loaded:
        return _loaded[folder]
    registered = next((found for found in _loaded.values() if found[0] is not None), None)
    if registered is not None:
        return registered
    try:
        path = build(folder)
        library = ctypes.CDLL(path)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.JaxserveInt8Dot), platform="cpu")
        _loaded[folder] = CpuInt8Dot(os.path.basename(path)), "int8's CPU kernel built for this machine"
    except Exception as e:  # noqa: BLE001 — XLA's dots, as without the kernel
        log.warning("int8's CPU kernel is not built here (%s: %s): XLA's dots", type(e).__name__, e)
        _loaded[folder] = None, f"no CPU kernel for int8 here ({type(e).__name__}: {e})"
    return _loaded[folder]


def build(folder: str) -> str:
    """The path of the kernel's library for this machine, compiled into `folder` unless there. Its
    name holds a hash of the source, the compiler and what `-march=native` means here."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler}) on the PATH")

    def run(*args, **kw) -> str:
        return subprocess.run([compiler, *args], capture_output=True, text=True, check=True, timeout=300, **kw).stdout
    machine = run("-march=native", "-E", "-dM", "-x", "c++", "-", input="")  # the CPU features it compiles for
    with open(SOURCE, "rb") as f:
        source = f.read()
    digest = hashlib.sha256(b"\0".join([source, run("--version").encode(), machine.encode(), " ".join(FLAGS).encode(),
                                        jax.ffi.include_dir().encode()])).hexdigest()[:16]
    path = os.path.join(folder, "cpu_kernels", f"int8_dot-{digest}.so")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:  # built apart, then renamed: atomic
            out = os.path.join(tmp, "int8_dot.so")
            try:
                run(*FLAGS, "-I", jax.ffi.include_dir(), SOURCE, "-o", out)
            except subprocess.CalledProcessError as e:
                raise RuntimeError(f"{compiler} failed: {e.stderr.strip()[-2000:]}") from e
            os.replace(out, path)
    return path
