"""Compiled steps kept on disk, so that a warm start skips tracing, lowering and compiling.

An entry is one serialized executable (`jax.experimental.serialize_executable`) with its argument
and result trees, stored under a fingerprint of everything that changes the program (the caller's
`describe` text: model and runner config, dtypes, shardings, jax version, backend, device kind,
XLA flags, the engine's own source) and the step's name. A file starts with the SHA-256 of its
payload: an entry that fails the check, or fails to load, is logged, removed and compiled again.

Loading runs pickle, so the folder must be the user's own (like jax's persistent cache): entries
are written with the process's umask into a folder made 0700.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile

from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

_DIGEST = 32  # bytes of SHA-256


@functools.cache
def source_digest() -> str:
    """SHA-256 of jaxserve's Python sources: an edited engine never loads an older program."""
    package = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(package)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


class ExecutableCache:
    """`load(name)` / `save(name, compiled)` of compiled steps for one program fingerprint."""

    def __init__(self, folder: str, describe: str, devices):
        """`devices`: the devices the programs run on, in their order (a mesh's, flattened): a
        program is loaded onto exactly those (XLA aborts on a device count that differs)."""
        self.folder = folder
        self.devices = list(devices)
        devices = ",".join(f"{d.platform}:{d.id}" for d in self.devices)
        self.fingerprint = hashlib.sha256(f"{describe}\n{devices}\n{source_digest()}".encode()).hexdigest()[:24]
        self.loaded = 0  # entries loaded ...
        self.rejected = 0  # ... and found corrupt or unloadable

    def _path(self, name: str) -> str:
        return os.path.join(self.folder, f"{self.fingerprint}-{name}.bin")

    def load(self, name: str):
        """The compiled step saved under `name`, or None (absent, corrupt or not loadable here)."""
        path = self._path(name)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except OSError:
            return None
        try:
            if len(blob) <= _DIGEST or hashlib.sha256(blob[_DIGEST:]).digest() != blob[:_DIGEST]:
                raise ValueError("checksum mismatch (truncated or corrupt)")
            payload, in_tree, out_tree = pickle.loads(blob[_DIGEST:])
            compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                 execution_devices=self.devices)
        except Exception as e:  # noqa: BLE001 — any bad entry is recompiled, never fatal
            log.warning("compile cache entry %s is unusable (%s: %s): compiling again", path, type(e).__name__, e)
            self.rejected += 1
            try:
                os.remove(path)
            except OSError:
                pass
            return None
        self.loaded += 1
        return compiled

    def save(self, name: str, compiled) -> None:
        """Writes the entry atomically; a read-only or full disk only costs a compile next time."""
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".partial")
            with os.fdopen(fd, "wb") as f:
                f.write(hashlib.sha256(blob).digest() + blob)
            os.replace(tmp, self._path(name))
        except Exception as e:  # noqa: BLE001
            log.warning("could not save compiled step %s (%s: %s)", name, type(e).__name__, e)
