"""The C++ kernels beside this file, each compiled for this machine (`-march=native`) at its first
use, kept in the cache folder, and registered with XLA's FFI. Where no C++ compiler is found, or a
build fails, `load` says why and the engine keeps XLA's ops."""

from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import jax

log = logging.getLogger(__name__)
HERE = os.path.dirname(os.path.abspath(__file__))
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")


def load(folder: str, name: str, symbol: str, target: str, loaded: dict) -> tuple[str | None, str]:
    """(the file name of kernel `name`'s library, built for this machine into `folder` (once; later
    processes read it back) with its handler `symbol` registered with XLA as `target`, or None
    where it cannot be: no compiler, a failed build; why). `loaded`: the kernel's own record of
    this process's loads, by folder. A process registers one build: a later folder gets the one
    already registered."""
    if folder in loaded:
        return loaded[folder]
    registered = next((found for found in loaded.values() if found[0] is not None), None)
    if registered is not None:
        return registered
    try:
        path = build(folder, name)
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(ctypes.CDLL(path), symbol)), platform="cpu")
        loaded[folder] = os.path.basename(path), "built for this machine"
    except Exception as e:  # noqa: BLE001 — XLA's ops, as without the kernel
        log.warning("the CPU kernel %s is not built here (%s: %s): XLA's ops", name, type(e).__name__, e)
        loaded[folder] = None, f"{type(e).__name__}: {e}"
    return loaded[folder]


def build(folder: str, name: str) -> str:
    """The path of kernel `name`'s library (`name`.cc beside this file) for this machine, compiled
    into `folder` unless there. Its name holds a hash of the sources (the headers beside it too),
    the compiler and what `-march=native` means here."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler}) on the PATH")

    def run(*args, **kw) -> str:
        return subprocess.run([compiler, *args], capture_output=True, text=True, check=True, timeout=300, **kw).stdout
    machine = run("-march=native", "-E", "-dM", "-x", "c++", "-", input="")  # the CPU features it compiles for
    source = os.path.join(HERE, f"{name}.cc")
    texts = []
    for path in [source, *sorted(glob.glob(os.path.join(HERE, "*.h")))]:
        with open(path, "rb") as f:
            texts.append(f.read())
    digest = hashlib.sha256(b"\0".join([*texts, run("--version").encode(), machine.encode(), " ".join(FLAGS).encode(),
                                        jax.ffi.include_dir().encode()])).hexdigest()[:16]
    path = os.path.join(folder, "cpu_kernels", f"{name}-{digest}.so")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:  # built apart, then renamed: atomic
            out = os.path.join(tmp, f"{name}.so")
            try:
                run(*FLAGS, "-I", jax.ffi.include_dir(), source, "-o", out)
            except subprocess.CalledProcessError as e:
                raise RuntimeError(f"{compiler} failed: {e.stderr.strip()[-2000:]}") from e
            os.replace(out, path)
    return path
