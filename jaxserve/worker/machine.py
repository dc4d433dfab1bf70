"""What the engine's "auto" settings mean on the machine it runs on, and why: the weights' dtype
and the KV pool's byte budget.

On GPUs and TPUs the weights are bfloat16 (float32 accumulation). On a CPU, XLA's bfloat16 dots are
fast only where the CPU has bfloat16 dot instructions (x86 `avx512_bf16` or `amx_bf16`, Arm
`bf16`); without them a bfloat16 dot runs slower than a float32 one (measured on an AVX2-only AMD
EPYC: the default bfloat16 decoded at 0.59x float32's speed at batch 1 and 0.88x at batch 64), so
there the weights are loaded in float32; `jaxserve.worker.dtype_plan` then measures, per step bucket,
whether a copy in the other dtype is the faster.
"""

from __future__ import annotations

import functools
import platform

import jax

BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # /proc/cpuinfo names (x86 flags, Arm features)
INT8_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm"})  # int8 dots, int32 sums


def _cpuinfo(*keys: str) -> str | None:
    """The first /proc/cpuinfo value under one of `keys` (None where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in keys:
                    return value.strip()
    except OSError:
        pass
    return None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return frozenset((_cpuinfo("flags", "features") or "").split())


def bf16_dot_instructions() -> list[str]:
    """The CPU's bfloat16 dot instruction sets among its flags (none: XLA emulates bfloat16 dots)."""
    return sorted(BF16_FLAGS & cpu_flags())


def int8_dot_instructions() -> list[str]:
    """The CPU's int8 dot instruction sets among its flags (w8a8, meant for them, is refused
    without one; int8's integer dots are chosen by timing them, `quantization_plan.integer_rows`)."""
    return sorted(INT8_FLAGS & cpu_flags())


def auto_async_scheduling() -> bool:
    """Overlap the host's scheduling with the device's step on accelerators; on a CPU the host
    thread takes a core from XLA (2 cores: steps in order ran 5% faster, and a request arriving
    over HTTP waited for the step already planned: time to first token 1.54x)."""
    return jax.default_backend() != "cpu"


CPU_KV_CACHE_BYTES = 1 << 30


def auto_kv_cache_bytes(memory_utilization: float) -> tuple[int, str]:
    """(bytes, reason) of the KV pool's budget when none is given: on an accelerator, the share
    `memory_utilization` of the device's memory less what is already in use (the weights); on a
    CPU, or where the device reports no memory, 1 GiB."""
    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return CPU_KV_CACHE_BYTES, "1 GiB default"
    limit, used = stats["bytes_limit"], stats.get("bytes_in_use", 0)
    budget = int(memory_utilization * limit) - used
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={memory_utilization} leaves no room for the KV cache: "
                         f"{used / 2**30:.2f} GiB of {limit / 2**30:.2f} GiB are in use")
    return budget, (f"{memory_utilization:.0%} of {limit / 2**30:.1f} GiB less {used / 2**30:.2f} GiB in use "
                    "(gpu_memory_utilization)")


@functools.cache
def auto_weights_dtype() -> tuple[str, str]:
    """(dtype, reason) that `dtype="auto"` resolves to here."""
    backend = jax.default_backend()
    if backend != "cpu":
        return "bfloat16", f"{backend}: bfloat16 weights, float32 accumulation"
    native = bf16_dot_instructions()
    if native:
        return "bfloat16", f"CPU with bfloat16 dot instructions ({', '.join(native)})"
    return "float32", (f"CPU ({platform.machine()}) without bfloat16 dot instructions: "
                       "XLA's bfloat16 dots run slower than float32 there")


@functools.cache
def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (what `lscpu` prints), or the platform's processor."""
    return _cpuinfo("model name") or platform.processor()
