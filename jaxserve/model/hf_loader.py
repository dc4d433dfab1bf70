"""Hugging Face checkpoint directories: config.json plus *.safetensors, mapped onto the canonical
weight names of `jaxserve.model.weights` (Llama, Mistral, Qwen2, Qwen3, Gemma 2 and Gemma 3 text)."""

from __future__ import annotations

import glob
import json
import os

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxserve.model.config import ModelConfig
from jaxserve.model.weights import check_weights

_LAYER_NAMES = {  # Hugging Face name within a layer -> (canonical name, is a matrix)
    "input_layernorm.weight": ("attn_norm", False),
    **{f"self_attn.{p}_proj.weight": (f"{p}_proj", True) for p in "qkvo"},
    **{f"self_attn.{p}_proj.bias": (f"{p}_bias", False) for p in "qkv"},
    **{f"self_attn.{p}_norm.weight": (f"{p}_norm", False) for p in "qk"},
    **{f"mlp.{p}_proj.weight": (f"{p}_proj", True) for p in ("gate", "up", "down")},
}
_LLAMA_NORMS = {"post_attention_layernorm.weight": "mlp_norm"}
_GEMMA_NORMS = {
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LLAMA_LAYER = _LAYER_NAMES | {k: (v, False) for k, v in _LLAMA_NORMS.items()}
_GEMMA_LAYER = _LAYER_NAMES | {k: (v, False) for k, v in _GEMMA_NORMS.items()}


def load_hf_config(path: str) -> ModelConfig:
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        raise FileNotFoundError(f"no config.json in {path}")
    with open(file) as f:
        return ModelConfig.from_hf(json.load(f))


def load_hf_checkpoint(path: str, dtype: str = "float32") -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Reads a checkpoint directory into (config, canonical weights as numpy arrays of `dtype`)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} does not exist or is not a directory")
    cfg = load_hf_config(path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    gemma = cfg.family in ("gemma2", "gemma3")
    weights: dict[str, np.ndarray] = {}
    for file in files:
        with safe_open(file, framework="flax") as f:
            for hf_name in f.keys():
                name, matrix = _canonical_name(hf_name, gemma)
                if name is None or (name == "lm_head" and cfg.tie_embeddings):
                    continue
                array = np.asarray(f.get_tensor(hf_name)).astype(np.float32)
                if gemma and name.endswith("norm"):
                    array = array + 1.0  # Gemma's RMSNorm multiplies by (1 + w)
                weights[name] = (array.T if matrix else array).astype(np_dtype)
    check_weights(cfg, weights, path)
    return cfg, weights


def _canonical_name(hf_name: str, gemma: bool) -> tuple[str | None, bool]:
    if hf_name.endswith(_IGNORED_SUFFIXES):
        return None, False
    name = hf_name.removeprefix("model.language_model.").removeprefix("language_model.").removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed", False
    if name == "norm.weight":
        return "final_norm", False
    if name == "lm_head.weight":
        return "lm_head", True
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers":
        layer_names = _GEMMA_LAYER if gemma else _LLAMA_LAYER
        if parts[2] in layer_names:
            canonical, matrix = layer_names[parts[2]]
            return f"layers.{parts[1]}.{canonical}", matrix
    raise ValueError(f"unexpected tensor {hf_name!r} in checkpoint")
