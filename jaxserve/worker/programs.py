"""The compiled programs of a runner's steps: each compiled once, or loaded from the compile cache
(`compile_cache`), and counted, so a steady workload compiles nothing.

A program is named by a key such as ("forward", 16); `build(key)` gives its jitted function and the
arguments to lower it with. `warmup` loads what the cache holds on every core, then compiles the
rest a few at a time.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Callable

from jaxserve.worker.compile_cache import ExecutableCache


class Programs:
    def __init__(self, build: Callable[[tuple], tuple], cache: ExecutableCache | None):
        self.build, self.cache = build, cache
        self.compiled: dict[tuple, object] = {}

    def __len__(self) -> int:
        """Programs compiled or loaded so far."""
        return len(self.compiled)

    def get(self, key: tuple):
        """The executable of `key`, compiled (or loaded) the first time it is asked for."""
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.compiled[key] = self._load(key) or self._compile(key)
        return compiled

    def _load(self, key: tuple):
        """The program of `key` from the compile cache, or None."""
        return self.cache.load(_name(key)) if self.cache is not None else None

    def _compile(self, key: tuple, pool: concurrent.futures.Executor | None = None):
        """The program of `key` compiled (and saved to the cache); a future if run in `pool`."""
        jitted, args = self.build(key)
        lowered = jitted.lower(*args)

        def compile_and_save():
            out = lowered.compile()
            if self.cache is not None:
                self.cache.save(_name(key), out)
            return out
        return compile_and_save() if pool is None else pool.submit(compile_and_save)

    def warmup(self, keys: list[tuple], progress=None, workers: int | None = None) -> int:
        """Loads every program of `keys` it can from the cache, then compiles the rest, `workers`
        compiles at a time; returns how many were new. `progress(done, total)` is called as each
        one is ready.

        Loads run on every core (deserializing releases the GIL). XLA's compile runs on threads
        of its own, so on 2 cores two compiles at once took longer than one after another
        (docs/startup.md): the default is one compile per 4 cores."""
        keys = [k for k in keys if k not in self.compiled]
        workers = workers or max(1, (os.cpu_count() or 1) // 4)
        done = 0

        def ready(key, compiled):
            nonlocal done
            self.compiled[key] = compiled
            done += 1
            if progress is not None:
                progress(done, len(keys))
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
            loaded = list(pool.map(self._load, keys))
        for key, compiled in zip(keys, loaded):
            if compiled is not None:
                ready(key, compiled)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            # lowering holds the GIL; compiles run meanwhile in the pool
            futures = {self._compile(key, pool): key for key, compiled in zip(keys, loaded) if compiled is None}
            for future in concurrent.futures.as_completed(futures):
                ready(futures[future], future.result())
        return len(keys)


def _name(key: tuple) -> str:
    """A program's name in the compile cache: ("forward", 16) -> "forward-16"."""
    return "-".join(map(str, key))
