"""Compiled steps kept on disk, so that a warm start skips tracing, lowering and compiling.

An entry is one serialized executable (`jax.experimental.serialize_executable`) with its argument
and result trees, stored under a fingerprint of everything that changes the program (the caller's
`describe` text: model and runner config, dtypes, shardings, jax version, backend, device kind,
XLA flags, the engine's own source) and the step's name. A file starts with the SHA-256 of its
payload: an entry that fails the check, or fails to load, is logged, removed and compiled again.

Loading runs pickle, so only the user may have written what is loaded: entries are written 0600
(by `mkstemp`) into a folder made 0700. An existing folder that another user owns or may write to
is refused when the cache opens, before anything in it is read, with how to fix it; an entry file
that fails the same test (another user's, or writable by others) is never unpickled, only
compiled again.

Every new engine version, config or jax version starts a new fingerprint, and an old one is never
read again: when the folder outgrows `max_bytes` (`$JAXSERVE_COMPILE_CACHE_MB`, 2 GiB by default),
opening a cache removes whole fingerprints, least recently used first (a load or save marks its
file used), never its own.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import tempfile

from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

_DIGEST = 32  # bytes of SHA-256
_SUFFIX = ".bin"


def default_max_bytes() -> int:
    return int(os.environ.get("JAXSERVE_COMPILE_CACHE_MB", "2048")) << 20


PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # jaxserve/, every subpackage in it


@functools.cache
def source_digest(package: str = PACKAGE) -> str:
    """SHA-256 of jaxserve's Python sources: an edited engine never loads an older program."""
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(package)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


class ExecutableCache:
    """`load(name)` / `save(name, compiled)` of compiled steps for one program fingerprint."""

    def __init__(self, folder: str, describe: str, devices, max_bytes: int | None = None):
        """`devices`: the devices the programs run on, in their order (a mesh's, flattened): a
        program is loaded onto exactly those (XLA aborts on a device count that differs)."""
        check_private(folder)
        self.folder = folder
        self.devices = list(devices)
        devices = ",".join(f"{d.platform}:{d.id}" for d in self.devices)
        self.fingerprint = hashlib.sha256(f"{describe}\n{devices}\n{source_digest()}".encode()).hexdigest()[:24]
        self.loaded = 0  # entries loaded ...
        self.rejected = 0  # ... and found corrupt or unloadable
        self.pruned = prune(folder, max_bytes if max_bytes is not None else default_max_bytes(), self.fingerprint)

    def _path(self, name: str) -> str:
        return os.path.join(self.folder, f"{self.fingerprint}-{name}{_SUFFIX}")

    def load(self, name: str):
        """The compiled step saved under `name`, or None (absent, corrupt or not loadable here)."""
        path = self._path(name)
        try:
            with open(path, "rb") as f:
                # the file opened, not the path: another file moved in after the check is not read
                unsafe = others_may_write(os.fstat(f.fileno()))
                blob = b"" if unsafe else f.read()
        except OSError:
            return None
        try:
            if unsafe:
                raise PermissionError(f"the file {unsafe}, so it is not unpickled")
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
        with contextlib.suppress(OSError):
            os.utime(path)  # used now: pruning goes by last use
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


def check_private(folder: str) -> None:
    """Raises ValueError when `folder` exists and is not the user's alone to write: whoever could
    put a file there could run code in this process when it is unpickled."""
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return
    unsafe = others_may_write(st)
    if unsafe:
        fix = f"chmod go-w {folder}" if st.st_uid == os.geteuid() else f"chown {os.geteuid()} {folder}"
        raise ValueError(f"the compile cache folder {folder} {unsafe}, and its entries are unpickled: run "
                         f"`{fix}` if it is yours, or point JAXSERVE_CACHE at a folder of your own")


def others_may_write(st: os.stat_result) -> str | None:
    """Why a file or folder may hold what another user wrote (owned by another user than this
    process's effective one, or writable by group or others), or None when only we could have."""
    if st.st_uid != os.geteuid():
        return f"is owned by another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"may be written by other users (mode {st.st_mode & 0o777:o})"
    return None


def prune(folder: str, max_bytes: int, keep: str) -> list[str]:
    """Removes the least recently used fingerprints' entries (a fingerprint's last use is its
    newest file's mtime) until the folder's entries fit in `max_bytes`; `keep`'s stay whatever
    their size. Returns the fingerprints removed."""
    groups: dict[str, list[tuple[str, os.stat_result]]] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    for name in names:
        if not name.endswith(_SUFFIX) or "-" not in name:
            continue
        path = os.path.join(folder, name)
        with contextlib.suppress(OSError):
            groups.setdefault(name.split("-", 1)[0], []).append((path, os.stat(path)))
    total = sum(st.st_size for files in groups.values() for _, st in files)
    removed = []
    for fingerprint in sorted((f for f in groups if f != keep), key=lambda f: max(st.st_mtime for _, st in groups[f])):
        if total <= max_bytes:
            break
        for path, st in groups[fingerprint]:
            with contextlib.suppress(OSError):
                os.remove(path)
            total -= st.st_size  # gone, or going: another process removed it first
        removed.append(fingerprint)
    if removed:
        log.info("compile cache over %d MiB: removed the programs of %d older configuration(s)", max_bytes >> 20,
                 len(removed))
    return removed
