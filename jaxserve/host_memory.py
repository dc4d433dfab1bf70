"""Keep freed host memory mapped, so XLA:CPU's large temporary buffers are not page-faulted in again
on every step.

glibc serves allocations above 32 MiB with fresh mmap()s and unmaps them on free, so each decode
step's gathered K/V and logits buffers were re-faulted 4 KiB at a time: writing them ran at
~3.5 GB/s instead of ~15 GB/s. Serving them from never-trimmed heaps fixes most of that, at the
price of the process keeping its peak memory. The threads keep their own arenas: with one arena
for all (MALLOC_ARENA_MAX=1), XLA's compile threads contended for its lock and every step program
compiled 1.3-1.8x slower, for no measured gain in step time. Setting the same through the
environment (MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...) before start-up works too.

It changes the whole process, so the engine never calls it on its own: `jaxserve generate`, the
`jaxserve serve` engine process and the benchmark scripts do; a program that embeds an `Engine`
may call `keep_freed_memory()` first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


@functools.cache
def keep_freed_memory() -> bool:
    """Tunes glibc malloc once per process; returns False where it does not apply."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 40)
                    and libc.mallopt(_M_TOP_PAD, 64 << 20))
    except (OSError, AttributeError):  # not glibc
        return False
