"""Model configuration: one frozen dataclass for every supported family.

The model code reads only this object; loaders (Hugging Face config.json, GGUF metadata) build it.
RMSNorm weights are always stored so that the norm multiplies by the weight itself: loaders of
checkpoints that keep Gemma's `(1 + w)` form add the 1 when they load.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

FAMILIES = ("llama", "gemma2", "gemma3")
ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_SCALINGS = ("linear", "llama3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling, as in Hugging Face `rope_scaling`."""

    kind: str  # "linear" or "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling type {self.kind!r} is not supported (supported: {ROPE_SCALINGS})")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and behaviour of a decoder-only transformer.

    `layer_windows[i]` is the sliding-window size of layer i, or None for a global layer;
    `layer_rope_thetas[i]` its RoPE base. Both default to global layers with `rope_theta`.
    """

    family: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False  # Qwen2 adds biases to the q, k and v projections
    activation: str = "silu"
    # Gemma 3 extras.
    layer_windows: tuple[int | None, ...] | None = None
    layer_rope_thetas: tuple[float, ...] | None = None
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(hidden_size)
    sandwich_norms: bool = False  # Gemma's post-attention and post-MLP norms
    query_scale: float | None = None  # None: 1/sqrt(head_dim)
    final_logit_softcap: float | None = None
    attn_logit_softcap: float | None = None
    # Special tokens.
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"model family {self.family!r} is not supported (supported: {FAMILIES})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not supported (supported: {ACTIVATIONS})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.layer_windows is None:
            object.__setattr__(self, "layer_windows", (None,) * self.num_layers)
        if self.layer_rope_thetas is None:
            object.__setattr__(self, "layer_rope_thetas", (float(self.rope_theta),) * self.num_layers)
        object.__setattr__(self, "layer_windows", tuple(self.layer_windows))
        object.__setattr__(self, "layer_rope_thetas", tuple(float(t) for t in self.layer_rope_thetas))
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        if len(self.layer_windows) != self.num_layers or len(self.layer_rope_thetas) != self.num_layers:
            raise ValueError("layer_windows and layer_rope_thetas need one entry per layer")
        if any(w is not None and w <= 0 for w in self.layer_windows):
            raise ValueError(f"sliding windows must be > 0, got {self.layer_windows}")

    @property
    def scale(self) -> float:
        """Multiplier applied to q·k before the softmax."""
        return self.query_scale if self.query_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Builds the config from a Hugging Face `config.json` dictionary."""
        model_type = hf.get("model_type", "llama")
        if model_type in ("gemma3", "gemma3_text"):
            return _gemma3_from_hf(hf.get("text_config", hf))
        if model_type == "gemma2":
            return _gemma2_from_hf(hf)
        if model_type not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ValueError(f"model_type {model_type!r} is not supported "
                             "(supported: llama, mistral, qwen2, qwen3, gemma2, gemma3_text)")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        # Mistral: one window for every layer. (Hugging Face's Llama ignores a `sliding_window` key.)
        window = hf.get("sliding_window") if model_type == "mistral" else None
        if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
            raise ValueError("Qwen sliding-window attention (use_sliding_window=true) is not supported")
        layers = hf["num_hidden_layers"]
        return cls(
            **_shapes(hf),
            family="llama",
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rope_theta=_rope_theta(hf, 10000.0),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            activation=_activation(hf.get("hidden_act", "silu")),
            layer_windows=(window,) * layers,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_as_tuple(hf.get("eos_token_id")),
            pad_token_id=hf.get("pad_token_id"),
        )


def _gemma3_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window", 4096)
    layer_types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % hf.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
        for i in range(layers)
    ]
    global_theta = _rope_theta(hf, 1_000_000.0)
    local_theta = float(hf.get("rope_local_base_freq", 10000.0))
    return ModelConfig(
        **_shapes(hf),
        family="gemma3",
        num_kv_heads=hf["num_key_value_heads"],
        head_dim=hf.get("head_dim", 256),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        rope_theta=global_theta,
        tie_embeddings=True,
        qk_norm=True,
        activation=_activation(hf.get("hidden_activation", "gelu_pytorch_tanh")),
        layer_windows=tuple(window if t == "sliding_attention" else None for t in layer_types),
        layer_rope_thetas=tuple(local_theta if t == "sliding_attention" else global_theta for t in layer_types),
        embed_scale=math.sqrt(hf["hidden_size"]),
        sandwich_norms=True,
        query_scale=hf.get("query_pre_attn_scalar", 256) ** -0.5,
        final_logit_softcap=hf.get("final_logit_softcapping"),
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
        bos_token_id=hf.get("bos_token_id", 2),
        eos_token_ids=_as_tuple(hf.get("eos_token_id", 1)),
        pad_token_id=hf.get("pad_token_id", 0),
    )


def _gemma2_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Gemma 2: Gemma 3's layers without QK-norm, one RoPE base, soft-capped attention and logits,
    and local and global layers alternating (local first)."""
    layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    base = _gemma3_from_hf({**hf, "layer_types": layer_types, "sliding_window": hf.get("sliding_window", 4096),
                            "rope_local_base_freq": _rope_theta(hf, 10000.0), "rope_theta": _rope_theta(hf, 10000.0),
                            "final_logit_softcapping": hf.get("final_logit_softcapping", 30.0),
                            "attn_logit_softcapping": hf.get("attn_logit_softcapping", 50.0),
                            "max_position_embeddings": hf.get("max_position_embeddings", 8192)})
    return base.replace(family="gemma2", qk_norm=False)


def _shapes(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The fields every family reads from config.json under the same names."""
    return dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_scaling=_rope_scaling(hf))


def _rope_theta(hf: Mapping[str, Any], default: float) -> float:
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5 nests per layer type
        params = params["full_attention"]
    return float(hf.get("rope_theta") or params.get("rope_theta") or default)


def _rope_scaling(hf: Mapping[str, Any]) -> RopeScaling | None:
    scaling = hf.get("rope_scaling")
    if scaling is None:
        params = hf.get("rope_parameters") or {}
        scaling = params.get("full_attention", params)
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    return RopeScaling(
        kind=kind,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def _activation(name: str) -> str:
    if name in ("silu", "swish"):
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise ValueError(f"activation {name!r} is not supported (supported: silu, gelu_pytorch_tanh)")


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
