"""What `dtype="auto"` resolves to on a CPU: bfloat16 only where the CPU has bfloat16 dot
instructions (docs/startup.md: without them XLA's bfloat16 dots ran slower than float32)."""

import pytest

from jaxserve.worker import machine


@pytest.mark.parametrize("flags,expected", [
    ({"avx2", "fma"}, "float32"),  # an AVX2-only AMD EPYC
    ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),  # AMD EPYC (Zen 4), Intel Cooper Lake
    ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, "bfloat16"),  # Intel Sapphire Rapids
    ({"fp", "asimd", "bf16"}, "bfloat16"),  # an Arm Neoverse V1
    (set(), "float32"),  # no /proc/cpuinfo
])
def test_auto_weights_dtype_follows_the_cpus_bfloat16_instructions(monkeypatch, flags, expected):
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset(flags))
    dtype, reason = machine.auto_weights_dtype.__wrapped__()
    assert dtype == expected
    assert ("bfloat16 dot instructions (" in reason) == (expected == "bfloat16")
