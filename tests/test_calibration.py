"""int8's layers rounded by GPTQ (jaxserve.worker.calibration): the rounding against round-to-nearest
and an exact case, the layers' input statistics against their inputs computed here in numpy, and
the cache of the rounding."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.loader import load_model
from jaxserve.model.quantization import dequantize, quantize
from jaxserve.model.weights import SCALES
from jaxserve.worker import calibration
from jaxserve.worker.calibration import INPUTS, gptq, input_grams, rounded_layers, stored_values


def output_error(w: np.ndarray, rounded: np.ndarray, gram: np.ndarray) -> float:
    """How far x @ w moves on inputs with Gram matrix `gram`: trace(dw^T G dw)."""
    d = (rounded - w).astype(np.float64)
    return float(np.trace(d.T @ gram @ d))


def correlated_inputs(rng, k: int) -> np.ndarray:
    x = rng.standard_normal((4000, k)) @ rng.standard_normal((k, k)) * np.exp(rng.standard_normal(k))
    return (x.T @ x / len(x)).astype(np.float32)


def test_gptq_keeps_each_channels_scale_and_moves_the_outputs_less_than_rounding_to_nearest():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((2, 160, 24)) * 0.05).astype(np.float32)  # two layers, 160 inputs: two blocks
    grams = np.stack([correlated_inputs(rng, 160) for _ in range(2)])
    q, s = (np.asarray(a) for a in gptq(jnp.asarray(w), jnp.asarray(grams)))
    assert q.dtype == np.int8 and s.dtype == np.float16 and q.shape == w.shape and s.shape == (2, 1, 24)
    for layer in range(2):
        nearest_q, nearest_s = quantize(w[layer], 0, None)
        assert np.array_equal(s[layer], nearest_s) and np.abs(q[layer]).max() <= 127
        nearest = output_error(w[layer], dequantize(nearest_q, nearest_s, 0), grams[layer])
        assert output_error(w[layer], dequantize(q[layer], s[layer], 0), grams[layer]) < 0.8 * nearest


def test_gptq_with_uncorrelated_inputs_is_rounding_to_nearest_and_zeroes_dead_inputs():
    """With a diagonal Gram matrix no row's error has another row to go to."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((1, 64, 8)) * 0.05).astype(np.float32)
    diag = np.exp(rng.standard_normal(64)).astype(np.float32)
    diag[[3, 40]] = 0  # inputs that are always 0
    q, s = (np.asarray(a)[0] for a in gptq(jnp.asarray(w), jnp.asarray(np.diag(diag)[None])))
    nearest_q, nearest_s = quantize(w[0], 0, None)
    live = diag > 0
    assert np.array_equal(s, nearest_s)
    assert np.array_equal(q[live], nearest_q[live]) and not q[~live].any()


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_the_first_layers_input_statistics_are_its_normed_embeddings(checkpoints, kind):
    cfg, weights, _, _ = load_model(checkpoints(kind))
    sequences = [[5, 17, 40, 9, 3, 3, 21], list(range(3, 30))]
    grams = input_grams(cfg, weights, sequences)
    assert len(grams) == cfg.num_layers and all(len(layer) == len(INPUTS) for layer in grams)
    embed = stored_values(weights, "embed")  # as the int8 model's embedding reads
    x = np.concatenate([embed[ids] for ids in sequences]).astype(np.float64) * cfg.embed_scale
    x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps) * weights["layers.0.attn_norm"]
    np.testing.assert_allclose(grams[0][0], x.T @ x / len(x), rtol=1e-4, atol=1e-5 * np.abs(x.T @ x / len(x)).max())
    for layer in grams:
        for gram in layer:
            assert np.allclose(gram, gram.T) and np.linalg.eigvalsh(gram).min() > -1e-4 * np.abs(gram).max()


def test_rounded_layers_are_per_channel_kept_in_the_cache_and_read_back(checkpoints, tmp_path, monkeypatch):
    cfg, weights, tokenizer, _ = load_model(checkpoints("llama"), quantization="int8")  # one scale per 32
    first = rounded_layers(cfg, weights, tokenizer, str(tmp_path))
    names = [f"layers.{i}.{m}" for i in range(cfg.num_layers) for kind in INPUTS for m in kind]
    for name in names:
        assert first[name].dtype == np.int8 and first[name + SCALES].shape == (1, weights[name].shape[1])
    assert first["embed"] is weights["embed"]  # the embedding is not a layer's
    assert len(os.listdir(tmp_path)) == 1
    rounding = calibration.gptq
    monkeypatch.setattr(calibration, "gptq", None)  # read back, not rounded again
    again = rounded_layers(cfg, weights, tokenizer, str(tmp_path))
    assert all(np.array_equal(again[k], first[k]) for k in first)
    assert rounded_layers(cfg, first, tokenizer, None) is first  # rounded already
    monkeypatch.setattr(calibration, "gptq", rounding)
    monkeypatch.setattr(calibration, "SOURCE", calibration.SOURCE + b"# changed")  # the rounding's code changed
    files = os.listdir(tmp_path)
    (tmp_path / "int8_layers-other-weights.npz").write_bytes(b"")  # another model's rounding
    changed = rounded_layers(cfg, weights, tokenizer, str(tmp_path))  # rounded again, the older file removed
    left = sorted(os.listdir(tmp_path))
    assert len(left) == 2 and "int8_layers-other-weights.npz" in left and files[0] not in left
    assert all(np.array_equal(changed[k], first[k]) for k in first)
