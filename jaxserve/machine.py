"""What `dtype="auto"` means on the machine the engine runs on, and why.

On GPUs and TPUs the weights are bfloat16 (float32 accumulation). On a CPU, XLA's bfloat16 dots are
fast only where the CPU has bfloat16 dot instructions (x86 `avx512_bf16` or `amx_bf16`, Arm
`bf16`); without them a bfloat16 dot runs slower than a float32 one (measured on an AVX2-only AMD
EPYC: the default bfloat16 decoded at 0.59x float32's speed at batch 1 and 0.88x at batch 64), so
there the weights stay float32.
"""

from __future__ import annotations

import functools
import platform

import jax

BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # /proc/cpuinfo names (x86 flags, Arm features)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("flags", "features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def auto_weights_dtype() -> tuple[str, str]:
    """(dtype, reason) that `dtype="auto"` resolves to here."""
    backend = jax.default_backend()
    if backend != "cpu":
        return "bfloat16", f"{backend}: bfloat16 weights, float32 accumulation"
    native = sorted(BF16_FLAGS & cpu_flags())
    if native:
        return "bfloat16", f"CPU with bfloat16 dot instructions ({', '.join(native)})"
    return "float32", (f"CPU ({platform.machine()}) without bfloat16 dot instructions: "
                       "XLA's bfloat16 dots run slower than float32 there")
