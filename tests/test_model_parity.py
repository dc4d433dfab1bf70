"""The Flax model against Hugging Face transformers on tiny random checkpoints (float32).

Prefill logits for every position (the prompt whole, or in chunks whose edges fall inside pages
or on them), then decode steps one token at a time through the paged pool (a permuted block
table, pages crossed), must match Hugging Face's full forward within 1e-4.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from model_helpers import paged_logits

from jaxserve.model.hf_loader import load_hf_checkpoint
from jaxserve.model.transformer import Transformer

TOL = 1e-4


@pytest.mark.parametrize("kind,chunk", [("llama", None), ("llama3", None), ("qwen2", None), ("qwen3", None),
                                        ("gemma3", None), ("llama", 5), ("qwen3", 8), ("gemma3", 3), ("gemma3", 8),
                                        ("gemma2", None), ("gemma2", 8), ("mistral", None), ("mistral", 5)])
def test_logits_match_hugging_face(checkpoints, kind, chunk):
    path = checkpoints(kind)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    cfg, weights = load_hf_checkpoint(path)
    model = Transformer(cfg, weights)
    tokens = np.random.RandomState(0).randint(3, cfg.vocab_size, size=30).astype(np.int32)
    with torch.no_grad():
        expected = hf(torch.tensor(tokens[None], dtype=torch.long)).logits[0].numpy()
    got = paged_logits(model, tokens, prompt_len=19, chunk=chunk)  # 19 and 30 tokens cross 8-token pages
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)
    if kind in ("gemma2", "gemma3", "mistral"):
        assert len(tokens) > cfg.layer_windows[0], "the sequence must be longer than the sliding window"


def test_missing_and_misshaped_tensors_are_named(checkpoints, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file
    src = checkpoints("llama")
    for case in ("missing", "misshaped"):
        dst = tmp_path / case
        shutil.copytree(src, dst)
        tensors = load_file(dst / "model.safetensors")
        if case == "missing":
            del tensors["model.layers.1.mlp.up_proj.weight"]
            expected = "layers.1.up_proj"
        else:
            tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:, :5]
            expected = "layers.0.k_proj"
        save_file(tensors, dst / "model.safetensors")
        with pytest.raises(ValueError, match=expected):
            load_hf_checkpoint(str(dst))


def test_missing_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_hf_checkpoint(str(tmp_path / "nowhere"))


def test_bfloat16_logits_stay_near_float32(checkpoints):
    path = checkpoints("llama")
    tokens = np.random.RandomState(0).randint(3, 150, size=20).astype(np.int32)
    f32 = paged_logits(Transformer(*load_hf_checkpoint(path)), tokens, prompt_len=12)
    bf16 = paged_logits(Transformer(*load_hf_checkpoint(path, "bfloat16"), dtype=jnp.bfloat16), tokens, prompt_len=12)
    assert bf16.dtype == np.float32  # logits come back in float32 whatever the weights
    np.testing.assert_allclose(bf16, f32, atol=0.05 * np.abs(f32).max())
