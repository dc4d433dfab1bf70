"""GGUF loading: the real Gemma 3 270M file against transformers, tiny written files for the rest."""

from __future__ import annotations

import gc
import math
import os
import shutil

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from jaxserve.model.config import ModelConfig  # noqa: E402
from jaxserve.model.gguf_loader import load_gguf, open_gguf, read_tensor  # noqa: E402

Q = gguf.GGMLQuantizationType

# ----------------------------------------------------------------------------------------------
# Tiny llama-architecture files written here


TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, layers=2, vocab=96)


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: rotate-half rows -> interleaved pairs, per head ([out, in] layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tiny_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights in Hugging Face layout ([out, in]) under GGUF names, before any permutation."""
    rng = np.random.default_rng(seed)
    d, f, k, h, n = TINY["hidden"], TINY["ffn"], TINY["head_dim"], TINY["heads"], TINY["kv_heads"]
    w = {"token_embd.weight": rng.standard_normal((TINY["vocab"], d)),
         "output_norm.weight": 1 + 0.1 * rng.standard_normal(d),
         "output.weight": rng.standard_normal((TINY["vocab"], d))}
    for i in range(TINY["layers"]):
        p = f"blk.{i}."
        w |= {p + "attn_norm.weight": 1 + 0.1 * rng.standard_normal(d),
              p + "ffn_norm.weight": 1 + 0.1 * rng.standard_normal(d),
              p + "attn_q.weight": rng.standard_normal((h * k, d)),
              p + "attn_k.weight": rng.standard_normal((n * k, d)),
              p + "attn_v.weight": rng.standard_normal((n * k, d)),
              p + "attn_output.weight": rng.standard_normal((d, h * k)),
              p + "ffn_gate.weight": rng.standard_normal((f, d)),
              p + "ffn_up.weight": rng.standard_normal((f, d)),
              p + "ffn_down.weight": rng.standard_normal((d, f))}
    return {name: (0.1 * v if v.ndim == 2 else v).astype(np.float32) for name, v in w.items()}


# Storage type per tensor kind: a mix of F32, F16 and Q8_0 (Q8_0 needs rows that are multiples of 32).
_STORAGE = {"attn_q": Q.Q8_0, "attn_k": Q.F16, "attn_v": Q.Q8_0, "attn_output": Q.F16, "ffn_gate": Q.Q8_0,
            "ffn_up": Q.F32, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0, "output": Q.F16}


def _storage(name: str):
    kind = name.split(".")[-2]
    return Q.F32 if name.endswith("norm.weight") else _STORAGE[kind]


def stored_values(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What a loader must read back: each tensor after the round trip through its storage type."""
    out = {}
    for name, v in hf.items():
        qt = _storage(name)
        if qt == Q.F16:
            out[name] = v.astype(np.float16).astype(np.float32)
        elif qt == Q.F32:
            out[name] = v
        else:
            out[name] = gguf.quants.dequantize(gguf.quants.quantize(v, qt), qt)
    return out


def write_tiny_gguf(path: str, arch: str = "llama", weights: dict[str, np.ndarray] | None = None,
                    extra_tensors=(), tokens: bool = True) -> None:
    """A small GGUF file with llama.cpp's key names; Q/K are permuted the way llama.cpp does."""
    hf = hf_tiny_weights() if weights is None else weights
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(TINY["layers"])
    w.add_context_length(256)
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_rope_dimension_count(TINY["head_dim"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(TINY["vocab"])
    if tokens:
        w.add_tokenizer_model("llama")
        toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(64)]
        toks += [f"\u2581t{i}" for i in range(TINY["vocab"] - len(toks))]
        w.add_token_list(toks)
        w.add_token_scores([0.0] * 3 + [0.0] * 64 + [-float(i) for i in range(TINY["vocab"] - 67)])
        w.add_token_types([2, 3, 3] + [6] * 64 + [1] * (TINY["vocab"] - 67))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    for name, v in hf.items():
        if arch == "llama" and ".attn_q." in name:
            v = llamacpp_permute(v, TINY["heads"])
        elif arch == "llama" and ".attn_k." in name:
            v = llamacpp_permute(v, TINY["kv_heads"])
        qt = _storage(name)
        if qt == Q.F32:
            w.add_tensor(name, v)
        elif qt == Q.F16:
            w.add_tensor(name, v.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(v, qt), raw_dtype=qt)  # byte rows
    for name, data, qt in extra_tensors:
        w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")
    write_tiny_gguf(path)
    return path


def test_tiny_llama_config(tiny_path):
    cfg, _ = load_gguf(tiny_path)
    assert cfg.family == "llama"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (64, 128, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, 96)
    assert cfg.rope_theta == 500000.0 and cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 256
    assert not cfg.tie_embeddings and not cfg.qk_norm and cfg.activation == "silu"
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


def test_tiny_llama_weights_unpermuted(tiny_path):
    """Every tensor reads back as written (through its F32/F16/Q8_0 storage), in [in, out] layout,
    with llama.cpp's Q/K permutation undone."""
    _, w = load_gguf(tiny_path)
    want = stored_values(hf_tiny_weights())
    assert set(w) >= {"embed", "lm_head", "final_norm", "layers.1.q_proj"}
    np.testing.assert_array_equal(w["embed"], want["token_embd.weight"])
    np.testing.assert_array_equal(w["lm_head"], want["output.weight"].T)
    np.testing.assert_array_equal(w["final_norm"], want["output_norm.weight"])
    names = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
             "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
    for i in range(TINY["layers"]):
        for g, c in names.items():
            np.testing.assert_array_equal(w[f"layers.{i}.{c}"], want[f"blk.{i}.{g}.weight"].T, err_msg=c)
            assert w[f"layers.{i}.{c}"].flags.c_contiguous
        np.testing.assert_array_equal(w[f"layers.{i}.attn_norm"], want[f"blk.{i}.attn_norm.weight"])
        np.testing.assert_array_equal(w[f"layers.{i}.mlp_norm"], want[f"blk.{i}.ffn_norm.weight"])


def test_tiny_llama_matches_transformers(tiny_path):
    """transformers' own GGUF reader (which reverses the permutation too) gives the same tensors."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(tiny_path)
    hf_cfg = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_cfg)
    tensors = load_gguf_checkpoint(tiny_path, return_tensors=True, model_to_load=model)["tensors"]
    _, w = load_gguf(tiny_path)
    for i in range(TINY["layers"]):
        for ours, theirs in (("q_proj", "self_attn.q_proj"), ("k_proj", "self_attn.k_proj"),
                             ("v_proj", "self_attn.v_proj"), ("o_proj", "self_attn.o_proj"),
                             ("gate_proj", "mlp.gate_proj"), ("down_proj", "mlp.down_proj")):
            hf = tensors[f"model.layers.{i}.{theirs}.weight"].float().numpy()
            np.testing.assert_array_equal(w[f"layers.{i}.{ours}"], hf.T, err_msg=ours)
    np.testing.assert_array_equal(w["embed"], tensors["model.embed_tokens.weight"].float().numpy())
    assert ModelConfig.from_hf(hf_cfg.to_dict()).replace(
        max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,), pad_token_id=None,
        rms_norm_eps=1e-5) == load_gguf(tiny_path)[0]


def test_copy_without_vocabulary_keeps_everything_else(tiny_path, tmp_path):
    """tests/gguf_strip.py, which the Gemma 3 reference model reads: tensors and every other
    metadata entry as they were, and the vocabulary's size where transformers looks for it."""
    from gguf_strip import copy_without_vocabulary
    dropped = {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"}
    copy = str(tmp_path / "copy.gguf")
    copy_without_vocabulary(tiny_path, copy)
    before, after = gguf.GGUFReader(tiny_path), gguf.GGUFReader(copy)
    assert set(after.fields) == set(before.fields) - dropped
    for key in set(after.fields) - {"GGUF.kv_count"}:  # the header's count of entries
        assert after.fields[key].contents() == before.fields[key].contents(), key
    assert after.fields["llama.vocab_size"].contents() == len(before.fields["tokenizer.ggml.tokens"].contents())
    assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
    for a, b in zip(after.tensors, before.tensors):
        assert a.tensor_type == b.tensor_type and np.array_equal(a.data, b.data), a.name


def test_llama3_rope_freqs(tmp_path):
    """llama.cpp keeps Llama 3.1 RoPE scaling only as a `rope_freqs` tensor; it maps back to
    RopeScaling(llama3, factor 8, low 1, high 4, original 8192)."""
    k, theta, factor, orig = TINY["head_dim"], 500000.0, 8.0, 8192
    freqs = theta ** -(np.arange(0, k, 2) / k)
    factors = []
    for wavelen in 2 * math.pi / freqs:  # the converter's formula
        if wavelen < orig / 4:
            factors.append(1.0)
        elif wavelen > orig / 1:
            factors.append(factor)
        else:
            smooth = (orig / wavelen - 1) / (4 - 1)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    path = str(tmp_path / "llama31.gguf")
    write_tiny_gguf(path, extra_tensors=[("rope_freqs.weight", np.array(factors, np.float32), None)])
    cfg, w = load_gguf(path)
    assert cfg.rope_scaling.kind == "llama3" and cfg.rope_scaling.factor == 8.0
    assert (cfg.rope_scaling.low_freq_factor, cfg.rope_scaling.high_freq_factor) == (1.0, 4.0)
    assert cfg.rope_scaling.original_max_position_embeddings == 8192
    assert "rope_freqs" not in " ".join(w)


def test_bfloat16(tiny_path):
    import ml_dtypes

    _, w32 = load_gguf(tiny_path)
    _, w16 = load_gguf(tiny_path, dtype="bfloat16")
    assert w16["layers.0.q_proj"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(w16["layers.0.q_proj"], w32["layers.0.q_proj"].astype(ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        load_gguf(tiny_path, dtype="int8")


def test_a_second_dtype_is_rounded_from_the_converted_float32(tiny_path, tmp_path, monkeypatch):
    """load_model keeps each dtype's conversion; once float32's exists, bfloat16's is its rounding
    (the same bits as converting the GGUF again), without reading the GGUF."""
    import ml_dtypes

    from jaxserve.model import gguf_loader
    from jaxserve.model.loader import load_model
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    _, w32, tok32, _ = load_model(tiny_path, "float32")
    monkeypatch.setattr(gguf_loader, "load_gguf", lambda *a, **k: pytest.fail("the GGUF was converted again"))
    _, w16, tok16, _ = load_model(tiny_path, "bfloat16")
    _, again, _, _ = load_model(tiny_path, "bfloat16")  # now from its own conversion
    _, expected = load_gguf(tiny_path, dtype="bfloat16")
    for name, value in expected.items():
        assert w16[name].dtype == again[name].dtype == ml_dtypes.bfloat16, name
        np.testing.assert_array_equal(w16[name].view(np.uint16), value.view(np.uint16), err_msg=name)
        np.testing.assert_array_equal(again[name].view(np.uint16), value.view(np.uint16), err_msg=name)
    assert tok16.encode("hello world") == tok32.encode("hello world")
    assert sorted(p.name.rsplit("-", 2)[1] for p in tmp_path.iterdir()) == ["bfloat16", "float32"]
    assert all((p / "weights.safetensors").is_file() for p in tmp_path.iterdir())  # the fast form, not Orbax's


def test_a_conversion_removes_older_formats_of_the_same_file_and_dtype_only(tiny_path, tmp_path, monkeypatch):
    from jaxserve.model.loader import CACHE_FORMAT, load_model
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    load_model(tiny_path, "float32")
    (ours,) = [p.name for p in tmp_path.iterdir()]
    stem = ours.removesuffix(f"-float32-{CACHE_FORMAT}")
    kept = [f"{stem}-bfloat16-{CACHE_FORMAT - 1}", f"other-float32-{CACHE_FORMAT - 1}", f"{stem}-float32-x"]
    for name in kept + [f"{stem}-float32-{CACHE_FORMAT - 1}", f"{stem}-float32-0"]:
        (tmp_path / name).mkdir()
    shutil.rmtree(tmp_path / ours)  # converted again, as after an upgrade to a new format
    load_model(tiny_path, "float32")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + [ours])


def test_metadata_matches_gguf_reader(tiny_path):
    """Our header parser agrees with gguf.GGUFReader on every key and tensor."""
    ours = open_gguf(tiny_path)
    ref = gguf.GGUFReader(tiny_path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = ours.metadata[key]
        got = got.tolist() if isinstance(got, np.ndarray) else got
        if isinstance(want, float) or (isinstance(want, list) and want and isinstance(want[0], float)):
            assert got == pytest.approx(want, rel=1e-6), key  # float32 values, shortest-repr rounded
        else:
            assert got == want, key
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert (mine.qtype, mine.offset, mine.n_bytes) == (t.tensor_type, t.data_offset, t.n_bytes)
        np.testing.assert_array_equal(ours.raw(t.name), t.data)


# ----------------------------------------------------------------------------------------------
# Errors


def test_truncated_file(tiny_path, tmp_path):
    data = open(tiny_path, "rb").read()
    for cut, where in ((len(data) // 2, "tensor"), (len(data) - 1, "tensor"), (200, "reading")):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated") as e:
            load_gguf(bad)
        msg = str(e.value)
        assert str(bad) in msg and f"ends at byte {cut}" in msg and where in msg
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_gguf(empty)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(junk)


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(missing)
    with pytest.raises(ValueError, match="directory"):
        load_gguf(tmp_path)


def test_unsupported_architecture(tmp_path):
    path = str(tmp_path / "mamba.gguf")
    write_tiny_gguf(path, arch="mamba")
    with pytest.raises(ValueError, match="'mamba'"):
        load_gguf(path)


def test_unsupported_quantization_type(tmp_path):
    # Q8_K (block 256) has no dequantizer in gguf.quants; one block of zero bytes is a valid tensor.
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_K]
    hf = hf_tiny_weights()
    hf.pop("output.weight")
    path = str(tmp_path / "q8k.gguf")
    write_tiny_gguf(path, weights=hf,
                    extra_tensors=[("output.weight", np.zeros((TINY["vocab"], 256 // block * size), np.uint8), Q.Q8_K)])
    with pytest.raises(ValueError, match=r"Q8_K.*|output\.weight") as e:
        load_gguf(path)
    assert "Q8_K" in str(e.value) and "output.weight" in str(e.value)


def test_unexpected_tensor(tmp_path):
    path = str(tmp_path / "extra.gguf")
    write_tiny_gguf(path, extra_tensors=[("blk.0.mystery.weight", np.zeros(8, np.float32), None)])
    with pytest.raises(ValueError, match="mystery"):
        load_gguf(path)


# ----------------------------------------------------------------------------------------------
# The real Gemma 3 270M file


@pytest.fixture(scope="module")
def gemma(gemma3_path):
    cfg, weights = load_gguf(gemma3_path)
    yield cfg, weights
    del weights
    gc.collect()


@pytest.fixture(scope="module")
def hf_gemma(hf_gemma3):
    """transformers' config and float32 state dict for the same file."""
    state = {k: v.detach().numpy() for k, v in hf_gemma3.state_dict().items()}
    yield hf_gemma3.config, state
    state.clear()


@pytest.mark.slow
def test_gemma_config_facts(gemma):
    cfg, _ = gemma
    assert cfg.family == "gemma3"
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (18, 640, 2048)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 1, 256, 262144)
    assert cfg.layer_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert [i for i, w in enumerate(cfg.layer_windows) if w is None] == [5, 11, 17]
    assert cfg.layer_rope_thetas == tuple(1e6 if (i + 1) % 6 == 0 else 1e4 for i in range(18))
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None
    assert cfg.query_scale == 256 ** -0.5 and cfg.embed_scale == math.sqrt(640)
    assert cfg.sandwich_norms and cfg.qk_norm and cfg.tie_embeddings and cfg.activation == "gelu_tanh"
    assert cfg.rms_norm_eps == 1e-6 and cfg.max_position_embeddings == 32768
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (2, (1,), 0)
    assert cfg.final_logit_softcap is None and cfg.attn_logit_softcap is None


@pytest.mark.slow
def test_gemma_config_matches_transformers(gemma, hf_gemma):
    cfg, _ = gemma
    hf_cfg, _ = hf_gemma
    from_hf = ModelConfig.from_hf(hf_cfg.to_dict())
    assert from_hf.rms_norm_eps == pytest.approx(cfg.rms_norm_eps, rel=1e-6)  # HF keeps float32's 9.99999997e-07
    assert from_hf.replace(rms_norm_eps=cfg.rms_norm_eps) == cfg


@pytest.mark.slow
def test_gemma_weights_match_transformers(gemma, hf_gemma):
    """Every dequantized tensor equals transformers' float32 weight for the same file, exactly
    (tolerance 0: both dequantize with gguf.quants; norms: ours = theirs + 1 exactly)."""
    cfg, w = gemma
    _, hf = hf_gemma
    pairs = {"embed": ("model.embed_tokens.weight", "as is"), "final_norm": ("model.norm.weight", "norm")}
    for i in range(cfg.num_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        for ours, (theirs, how) in {
            "q_proj": ("self_attn.q_proj", "T"), "k_proj": ("self_attn.k_proj", "T"),
            "v_proj": ("self_attn.v_proj", "T"), "o_proj": ("self_attn.o_proj", "T"),
            "gate_proj": ("mlp.gate_proj", "T"), "up_proj": ("mlp.up_proj", "T"), "down_proj": ("mlp.down_proj", "T"),
            "q_norm": ("self_attn.q_norm", "norm"), "k_norm": ("self_attn.k_norm", "norm"),
            "attn_norm": ("input_layernorm", "norm"), "post_attn_norm": ("post_attention_layernorm", "norm"),
            "mlp_norm": ("pre_feedforward_layernorm", "norm"), "post_mlp_norm": ("post_feedforward_layernorm", "norm"),
        }.items():
            pairs[p + ours] = (q + theirs + ".weight", how)
    assert set(pairs) == set(w)
    worst = 0.0
    for ours, (theirs, how) in pairs.items():
        ref = hf[theirs]
        if how == "T":
            ref = ref.T
        elif how == "norm":  # transformers keeps Gemma's w and computes (1 + w) in forward
            ref = ref + np.float32(1.0)
        assert w[ours].dtype == np.float32 and w[ours].shape == ref.shape, ours
        worst = max(worst, float(np.max(np.abs(w[ours] - ref))))
    assert worst == 0.0


@pytest.mark.slow
def test_gemma_bfloat16_is_rounded_float32(gemma, gemma3_path):
    import ml_dtypes

    _, w32 = gemma
    f = open_gguf(gemma3_path)  # four tensors (Q8_0, Q5_0, Q6_K, F32), not the whole file again
    for name, stored in (("embed", "token_embd.weight"), ("layers.3.q_proj", "blk.3.attn_q.weight"),
                         ("layers.17.down_proj", "blk.17.ffn_down.weight"), ("final_norm", "output_norm.weight")):
        w16 = read_tensor(f, stored, "bfloat16", transpose=name.endswith("proj"))
        assert w16.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(w16, w32[name].astype(ml_dtypes.bfloat16))


@pytest.mark.slow
def test_gemma_truncated_copy(gemma3_path, tmp_path):
    bad = tmp_path / "half.gguf"
    with open(gemma3_path, "rb") as src:
        bad.write_bytes(src.read(os.path.getsize(gemma3_path) // 2))
    with pytest.raises(ValueError, match="truncated.*ends at byte"):
        load_gguf(bad)
