"""int8 weights (jaxserve.model.quantization): the stored values and scales, the dots against a
float64 numpy reference of the same int8 weights, whole models against the float model run on
the weights the int8 ones stand for, the compiled programs (no full-size converted copy of a
weight), the compile cache's key, and the errors and choices of `quantization=`."""

from __future__ import annotations

import dataclasses
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import Engine, EngineConfig, SamplingParams
from jaxserve.model import quantization
from jaxserve.model.loader import CACHE_FORMAT, load_model
from jaxserve.model.quantization import GROUP, GROUPS, OUTLIERS, Int8Dot, dequantize, quantize, split_rows, with_outliers
from jaxserve.model.weights import SCALES
from jaxserve.worker.calibration import rounded_layers
from jaxserve.model.transformer import Transformer
from model_helpers import paged_logits

KINDS = ["llama", "llama3", "qwen3", "gemma3"]  # untied, tied, untied with qk-norm, tied with sliding windows
MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LOGIT_TOL = 2e-4  # float32 on both sides, the same weights: only the order of the sums differs


def test_quantize_stores_each_group_within_half_a_step_of_its_weights():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 5)).astype(np.float32)
    w[32:64, 1] = 0  # an all-zero group
    q, s = quantize(w, 0, 32)
    assert q.dtype == np.int8 and s.dtype == np.float16 and s.shape == (3, 5)
    assert np.abs(q).max() == 127 and s[1, 1] == 1 and not q[32:64, 1].any()
    step = np.repeat(s.astype(np.float32), 32, axis=0)
    assert np.all(np.abs(dequantize(q, s, 0) - w) <= step / 2 * (1 + 1e-6))
    assert np.array_equal(q[:32, 0], np.round(w[:32, 0] / np.float32(s[0, 0])).astype(np.int8))
    per_channel_q, per_channel_s = quantize(w.T, 1, None)  # contracted along axis 1, one scale a row
    assert per_channel_s.shape == (5, 1) and per_channel_q.shape == (5, 96)
    assert quantize(w, 0, 7)[1].shape == (1, 5)  # a group that does not divide the axis: per channel


def outlier_weights(q, s, channels, kept, axis: int) -> np.ndarray:
    """The float32 weights an output layer laid out by `with_outliers` stands for."""
    w = dequantize(q, s, axis)
    index = [slice(None)] * 2
    index[axis] = np.asarray(channels)
    w[tuple(index)] = np.asarray(kept)
    return w


@pytest.mark.parametrize("axis", [1, 0])  # a tied embedding [V, D], an output layer [D, V]
def test_the_output_layer_keeps_its_largest_input_channels_in_float_and_the_rest_per_channel(axis):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((300, 64)).astype(np.float32) * 0.05  # [V, D]
    w[:, [5, 40]] *= 30  # two outlier input channels
    w = w if axis == 1 else w.T
    q, s = quantize(w, axis, GROUP)
    layout = q_, s_, channels, kept = [np.asarray(a) for a in with_outliers(jnp.asarray(q), jnp.asarray(s), axis, 4)]
    source = dequantize(q, s, axis)  # what the blocks stand for
    magnitude = np.abs(source).max(axis=1 - axis)
    assert set(channels) == set(np.argsort(magnitude)[-4:]) and {5, 40} <= set(channels) and list(channels) == sorted(channels)
    assert np.array_equal(kept, np.take(source, channels, axis=axis))  # as they were, not rounded again
    assert not np.take(q_, channels, axis=axis).any() and s_.shape[axis] == 1  # one scale per output channel
    step = s_.astype(np.float32)
    assert np.all(np.abs(outlier_weights(*layout, axis) - source) <= step / 2 * (1 + 1e-6))


INTEGER = 2  # integer dots up to this many rows, in the tests that take them


def reference_dot(x, q, s, axis: int, w8a8: bool, split: bool = False) -> np.ndarray:
    """float64 numpy: x @ w (axis 0: q [K, N]) or x @ w.T (axis 1: q [N, K]); with w8a8, x
    rounded to int8 per row first, as the engine does; with `split`, to 15 bits per row."""
    x = np.asarray(x, np.float64)
    if w8a8 or split:
        levels = 127 * 128 if split else 127
        xs = np.abs(x).max(axis=1, keepdims=True) / levels
        x = np.clip(np.round(x / xs), -levels, levels) * xs
    w = np.asarray(dequantize(q, s, axis), np.float64)
    return x @ (w if axis == 0 else w.T)


def test_split_rows_are_each_rows_15_bit_rounding_as_two_int8_rows():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((3, 200)) * np.exp(rng.standard_normal((3, 1)) * 3)).astype(np.float32)
    x[1, 7] = 0
    q, scale = (np.asarray(a) for a in split_rows(jnp.asarray(x)))
    assert q.dtype == np.int8 and q.shape == (6, 200) and scale.shape == (3, 1)
    high, low = q[:3].astype(np.int64), q[3:].astype(np.int64)
    assert np.abs(high).max() == 127 and np.abs(low).max() <= 64
    value = 128 * high + low
    assert np.abs(value).max() == 127 * 128 and not value[1, 7]
    assert np.abs(value - x / scale).max() <= 0.5 + 1e-3  # the nearest step (up to float32's division)


@pytest.mark.parametrize("mode,group,integer", [("int8", GROUP, False), ("int8", None, False), ("int8", None, True),
                                                ("w8a8", None, False)])
def test_the_dots_equal_a_float64_reference_of_the_same_int8_weights(mode, group, integer):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((INTEGER, 64)).astype(np.float32)  # integer dots up to INTEGER rows
    w = rng.standard_normal((64, 256)).astype(np.float32) * 0.1
    q, s = quantize(w, 0, group)
    tied_q, tied_s = quantize(w.T, 1, group)  # [V, D] as a tied embedding
    for rows in (0, 64):  # the whole output layer at once, and in 4 blocks
        dot = Int8Dot(mode, "float32", rows, group, 0, INTEGER if integer else 0)
        cases = [(dot.dense(x, q, s), reference_dot(x, q, s, 0, mode == "w8a8", integer)),
                 (dot.dense(x[None], q, s)[0], reference_dot(x, q, s, 0, mode == "w8a8", integer)),  # [1, R, K]
                 (dot.output_layer(x, q, s, tied=False), reference_dot(x, q, s, 0, mode == "w8a8", integer)),
                 (dot.output_layer(x, tied_q, tied_s, tied=True),
                  reference_dot(x, tied_q, tied_s, 1, mode == "w8a8", integer))]
        held = dataclasses.replace(dot, layers_transposed=True)  # the layers [out, in], as a tied embedding
        cases.append((held.dense(x, tied_q, tied_s), reference_dot(x, tied_q, tied_s, 1, mode == "w8a8", integer)))
        if integer:  # more rows: converted dots, the activations as they are
            more = rng.standard_normal((INTEGER + 3, 64)).astype(np.float32)
            cases += [(dot.dense(more, q, s), reference_dot(more, q, s, 0, False)),
                      (held.dense(more, tied_q, tied_s), reference_dot(more, tied_q, tied_s, 1, False)),
                      (dot.output_layer(more, tied_q, tied_s, tied=True), reference_dot(more, tied_q, tied_s, 1, False))]
        for got, want in cases:
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    rows = Int8Dot(mode, "float32", 0, group).embedding(tied_q, tied_s, jnp.array([3, 0, 255]))
    np.testing.assert_allclose(np.asarray(rows), dequantize(tied_q, tied_s, 1)[[3, 0, 255]], rtol=1e-6)


def test_the_output_layer_with_float_channels_equals_a_float64_reference():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = rng.standard_normal((64, 256)).astype(np.float32) * 0.1
    untied = [np.asarray(a) for a in with_outliers(*quantize(w, 0, GROUP), 0, 8)]
    tied = [np.asarray(a) for a in with_outliers(*quantize(w.T, 1, GROUP), 1, 8)]
    for rows in (0, 64):
        dot = Int8Dot("int8", "float32", rows, GROUP, 8)
        for layout, axis in ((untied, 0), (tied, 1)):
            q, s, channels, kept = layout
            want = x.astype(np.float64) @ (outlier_weights(*layout, axis).astype(np.float64) if axis == 0
                                          else outlier_weights(*layout, axis).T.astype(np.float64))
            got = dot.output_layer(x, q, s, axis == 1, channels, kept)
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    rows = Int8Dot("int8", "float32", 0, GROUP, 8).embedding(*map(jnp.asarray, tied[:2]), jnp.array([3, 0, 255]),
                                                             *map(jnp.asarray, tied[2:]))
    np.testing.assert_allclose(np.asarray(rows), outlier_weights(*tied, 1)[[3, 0, 255]], rtol=1e-6)


def test_w8a8_takes_one_scale_per_output_channel():
    with pytest.raises(ValueError, match="per output channel"):
        Int8Dot("w8a8", "float32", 0, GROUP)


def dequantized_weights(weights: dict, cfg) -> dict:
    """The float weights int8 ones stand for: each layer matrix int8 already (`rounded_layers`)
    dequantized, or float through quantize and back, one scale per output channel, as the model
    quantizes it (fusing q/k/v and gate/up only reorders columns); the embedding per 32, and the
    output layer laid out again with its largest input channels in float."""
    out = {name: w for name, w in weights.items() if not name.endswith(SCALES)}
    for name, w in out.items():
        if name.split(".")[-1] in MATRICES:
            out[name] = dequantize(w, weights[name + SCALES], 0) if w.dtype == np.int8 else \
                dequantize(*quantize(w, 0, GROUPS["int8"]), 0)
        elif name == "lm_head":
            out[name] = dequantize(*quantize(w, 0, GROUP), 0)
    out["embed"] = dequantize(*quantize(weights["embed"], 1, GROUP), 1)
    name, axis = ("embed", 1) if cfg.tie_embeddings else ("lm_head", 0)
    layout = with_outliers(*quantize(weights[name], axis, GROUP), axis, OUTLIERS["int8"])
    out[name] = outlier_weights(*layout, axis)
    return out


@pytest.fixture(scope="module")
def models(checkpoints):
    return {kind: load_model(checkpoints(kind))[:3] for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_int8_logits_equal_the_float_model_on_the_weights_they_stand_for(models, kind):
    cfg, weights, _ = models[kind]
    tokens = np.arange(3, 23, dtype=np.int32)
    quant = Int8Dot("int8", "float32", 0, GROUPS["int8"], OUTLIERS["int8"])
    got = paged_logits(Transformer(cfg, weights, quant=quant), tokens, prompt_len=16)
    want = paged_logits(Transformer(cfg, dequantized_weights(weights, cfg)), tokens, prompt_len=16)
    assert np.abs(got - want).max() < LOGIT_TOL * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("kind", KINDS)
def test_w8a8_logits_stay_near_the_float_model(models, kind):
    """Its activations are rounded to int8 too, so the bound is the quantization's: measured on the
    default model in docs/quantization.md; here only that it runs every family close to float."""
    cfg, weights, _ = models[kind]
    tokens = np.arange(3, 23, dtype=np.int32)
    got = paged_logits(Transformer(cfg, weights, quant=Int8Dot("w8a8", "float32", 0, None)), tokens, prompt_len=16)
    want = paged_logits(Transformer(cfg, weights), tokens, prompt_len=16)
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_an_int8_engine_decodes_the_float_engines_greedy_tokens_on_the_weights_they_stand_for(models, kind):
    cfg, weights, tokenizer = models[kind]
    config = EngineConfig(dtype="float32", max_slots=4, page_size=8, num_pages=96, max_model_len=128)
    prompts = [[5, 17, 40, 9], list(range(3, 30)), [7] * 11]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    int8 = rounded_layers(cfg, weights, tokenizer)  # as the engine rounds them
    got = Engine(cfg, int8, tokenizer, config.replace(quantization="int8")).generate(prompts, greedy)
    want = Engine(cfg, dequantized_weights(int8, cfg), tokenizer, config).generate(prompts, greedy)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def converted_copies(hlo: str, sizes: set[int]) -> list[str]:
    """The float arrays of the compiled program whose element count is that of a whole int8 weight."""
    found = re.findall(r"= (f32|bf16)\[([0-9,]*)\]", hlo)
    return [f"{t}[{s}]" for t, s in found if math.prod(int(d) for d in s.split(",") if d) in sizes]


def test_no_step_program_holds_a_float_copy_of_a_whole_int8_weight(models, monkeypatch):
    """On a CPU XLA converts an int8 operand whole before its dot: the layers' matrices are converted
    one layer at a time inside the scan, and the output layer (the tied embedding) one block of
    rows at a time. TILE_ELEMENTS is shrunk so that this tiny vocabulary comes in 4 blocks, as
    Gemma 3's 262,144 rows come in 64."""
    cfg, weights, tokenizer = models["gemma3"]
    monkeypatch.setattr(quantization, "TILE_ELEMENTS", cfg.vocab_size * cfg.hidden_size // 4)
    engine = Engine(cfg, weights, tokenizer, EngineConfig(dtype="float32", quantization="int8", max_slots=4,
                                                          page_size=8, num_pages=64, max_model_len=128))
    assert engine.runner.quant.block_rows == cfg.vocab_size // 4
    int8 = [x for x in jax.tree.leaves(engine.runner.state) if x.dtype == jnp.int8]
    assert {x.ndim for x in int8} == {2, 3}  # the embedding, and the layers' stacked matrices
    sizes = {x.size for x in int8}
    keys = [k for k in engine.runner.all_programs() if k[0] in ("forward", "sample")]
    for key in keys[:2] + keys[-1:]:
        jitted, args = engine.runner.program(key)
        assert converted_copies(jitted.lower(*args).compile().as_text(), sizes) == [], key


def with_int8_dots(monkeypatch):
    """w8a8 is refused on a CPU without int8 dot instructions: the tests that build it say the CPU has
    them (XLA's integer dots then run, slowly, on any CPU)."""
    from jaxserve.worker import machine
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512_vnni"}))


def test_the_compile_cache_keys_differ_between_quantizations(models, monkeypatch):
    with_int8_dots(monkeypatch)
    cfg, weights, tokenizer = models["llama"]
    config = EngineConfig(dtype="float32", max_slots=4, page_size=8, num_pages=64, max_model_len=128)
    keys = {mode: Engine(cfg, weights, tokenizer, config.replace(quantization=mode)).runner.describe_programs()
            for mode in (None, "int8", "w8a8")}
    assert len(set(keys.values())) == 3


def test_bad_quantizations_are_value_errors_naming_the_choices(models, monkeypatch):
    with pytest.raises(ValueError, match=r"quantization must be one of \(None, 'int8', 'w8a8', 'auto'\)"):
        EngineConfig(quantization="int3")
    from jaxserve.worker import machine
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    cfg, weights, tokenizer = models["llama"]
    with pytest.raises(ValueError, match="w8a8.*int8 dot instructions.*'int8'"):
        Engine(cfg, weights, tokenizer, EngineConfig(dtype="float32", quantization="w8a8", num_pages=64,
                                                     max_model_len=128))


@pytest.mark.parametrize("timings,chosen", [({"none": 10.0, "int8": 5.0}, "int8"),
                                            ({"none": 10.0, "int8": 9.5}, None),  # not clearly faster
                                            (RuntimeError("no measurement"), None)])
def test_auto_takes_int8_only_where_it_is_clearly_faster_and_never_fails(timings, chosen, tmp_path):
    from jaxserve.model.config import ModelConfig
    from jaxserve.worker.quantization_plan import auto_quantization

    def measure(cfg, dtype, rows):
        if isinstance(timings, Exception):
            raise timings
        return timings
    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=128)
    mode, why = auto_quantization(cfg, "float32", 1, str(tmp_path / "plans.json"), measure)
    assert mode == chosen and why.startswith("auto")
    if not isinstance(timings, Exception):  # kept: the next start reads it
        assert auto_quantization(cfg, "float32", 1, str(tmp_path / "plans.json"), None) == (mode, why)


FASTER, TIE, SLOWER = (20.0, 10.0), (10.0, 10.2), (10.0, 30.0)  # ms (converted, integer)
TINY = (0.2, 0.1)  # a tiny model's: under a millisecond apart


@pytest.mark.parametrize("timings,chosen,asked", [
    # per part, (converted, integer) ms at 1, 2, 4, ... rows; what is chosen, and the rows each part was timed at
    ({"layers": [TIE, FASTER, FASTER, SLOWER], "output layer": [FASTER] * 9}, (4, 256), (4, 9)),  # a tie at 1 row
    ({"layers": [SLOWER], "output layer": [FASTER] * 5 + [SLOWER]}, (0, 16), (1, 6)),  # slower at one row
    ({"layers": [FASTER, SLOWER], "output layer": [FASTER, TIE, SLOWER]}, (1, 2), (2, 3)),  # a tie after a win
    ({"layers": [FASTER, FASTER, TIE, TIE, SLOWER], "output layer": [TIE] * 9}, (8, 0), (5, 9)),  # ties alone: none
    ({"layers": [FASTER] * 8 + [SLOWER], "output layer": [FASTER] * 7 + [SLOWER]}, (128, 64), (9, 8)),  # prompt chunks
    ({"layers": [TINY] * 9, "output layer": [TINY] * 9}, (0, 0), (9, 9)),
    (RuntimeError("no measurement"), (0, 0), None)])
def test_integer_dots_are_taken_up_to_the_most_rows_where_they_were_clearly_faster_or_tied_after(
        timings, chosen, asked, tmp_path, monkeypatch):
    from jaxserve.model.config import ModelConfig
    from jaxserve.worker import quantization_plan
    candidates = quantization_plan.INTEGER_CANDIDATES
    measured = {part: [] for part in quantization_plan.PARTS}

    def measure(rows, parts):
        if isinstance(timings, Exception):
            raise timings
        for part in parts:
            measured[part].append(rows)
        return {part: dict(zip(("converted", "integer"), timings[part][candidates.index(rows)])) for part in parts}
    cfg = ModelConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18, num_heads=4,
                      num_kv_heads=1, head_dim=256, max_position_embeddings=128)  # Gemma 3 270M's shapes
    tiny = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, max_position_embeddings=128)
    monkeypatch.setattr(quantization_plan, "_chosen", {})
    plans = str(tmp_path / "plans.json")
    rows, why = quantization_plan.integer_rows(cfg, "float32", plans, measure)
    assert rows == chosen
    if isinstance(timings, Exception):
        assert "could not be timed" in why
        return
    for part, most in zip(quantization_plan.PARTS, chosen):
        assert (f"{part} up to {most} rows" if most else f"{part} converted") in why
    assert tuple(len(measured[part]) for part in quantization_plan.PARTS) == asked  # settled parts are timed no more
    assert all(measured[part] == list(candidates[:len(measured[part])]) for part in measured)
    assert quantization_plan.integer_rows(cfg, "float32", plans, measure) == (rows, why)  # once per process
    monkeypatch.setattr(quantization_plan, "_chosen", {})  # a new process reads the file
    assert quantization_plan.integer_rows(cfg, "float32", plans, measure) == (rows, why)
    assert tuple(len(measured[part]) for part in quantization_plan.PARTS) == asked
    assert quantization_plan.integer_rows(tiny, "float32", plans, measure)[0] == (0, 0)  # not timed: too small
    with monkeypatch.context() as m:  # each process of a multi-host group would choose its own
        m.setattr(jax, "process_count", lambda: 2)
        m.setattr(quantization_plan, "_chosen", {})
        assert quantization_plan.integer_rows(cfg, "float32", plans, measure)[0] == (0, 0)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # XLA fuses the conversion there
    assert quantization_plan.integer_rows(cfg, "float32", plans, measure)[0] == (0, 0)
    assert tuple(len(measured[part]) for part in quantization_plan.PARTS) == asked


def test_describe_says_what_is_quantized_and_the_bytes_held(models):
    cfg, weights, tokenizer = models["gemma3"]
    config = EngineConfig(dtype="float32", max_slots=4, page_size=8, num_pages=64, max_model_len=128)
    plain = Engine(cfg, weights, tokenizer, config).describe().splitlines()[2]
    int8 = Engine(cfg, weights, tokenizer, config.replace(quantization="int8"))
    line = int8.describe().splitlines()[2]
    assert "not quantized (the default)" in plain
    how = ("of the activations rounded to 15 bits, int32 sums" if int8.runner.quant.integer_rows
           else "int8, read in float32")  # where the CPU has int8 dot instructions
    assert how in line and "float16 scales one per output channel, the layers rounded by GPTQ" in line
    assert "(asked for)" in line
    held = sum(x.nbytes for x in jax.tree.leaves(int8.runner.states))
    assert f"{held / 2**30:.2f} GiB" in line
    matrices = [x for x in jax.tree.leaves(int8.runner.state) if x.dtype == jnp.int8]
    assert sum(x.size for x in matrices) == sum(w.size for n, w in weights.items()
                                                if n.split(".")[-1] in MATRICES or n in ("embed", "lm_head"))


def q8_0_blocks(raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(int8 values [rows, K], float16 scales [rows, K / 32]) of a Q8_0 tensor's stored bytes: each
    block is its float16 scale, then 32 int8 values."""
    blocks = np.asarray(raw, np.uint8).reshape(rows, -1, 34)
    return blocks[..., 2:].view(np.int8).reshape(rows, -1), blocks[..., :2].copy().view(np.float16)[..., 0]


def test_gguf_q8_0_tensors_load_as_their_stored_int8_values_and_scales(tmp_path, monkeypatch):
    """A Q8_0 block is 32 weights along a dot's inputs with a float16 scale: int8's stored layout,
    so the loader takes the values and scales gguf wrote as they are, even for a bfloat16 engine
    (through bfloat16 weights they would not come back); the engine keeps the embedding so, and
    rounds the layers again per output channel from exactly those values."""
    import gguf
    from test_gguf_loader import TINY, hf_tiny_weights, write_tiny_gguf
    path = str(tmp_path / "tiny.gguf")
    hf = hf_tiny_weights()
    write_tiny_gguf(path, weights=hf)  # token_embd, ffn_gate and ffn_down (among others) in Q8_0
    cfg, weights, tokenizer, _ = load_model(path, "bfloat16", quantization="int8")
    engine = Engine(cfg, weights, tokenizer, EngineConfig(dtype="bfloat16", quantization="int8", num_pages=64,
                                                          max_model_len=128))
    state = engine.runner.state
    Q8_0 = gguf.GGMLQuantizationType.Q8_0

    def stored(name):  # [out, in] as written, blocks along `in`
        return q8_0_blocks(gguf.quants.quantize(hf[name], Q8_0), hf[name].shape[0])
    q, s = stored("token_embd.weight")  # the embedding [V, D]: blocks along D, as stored
    assert np.array_equal(weights["embed"], q) and np.array_equal(weights["embed.scales"], s)
    assert np.array_equal(np.asarray(state["embed"][...]), q)  # untied: only gathered, kept as stored
    assert np.array_equal(np.asarray(state["embed_scales"][...]), s)
    rounded = rounded_layers(cfg, weights, tokenizer)
    mlp = state["layers"]["mlp"]
    for layer in range(TINY["layers"]):
        q, s = stored(f"blk.{layer}.ffn_down.weight")  # [D, F] -> down [F, D], blocks along F
        name = f"layers.{layer}.down_proj"  # the stored values, for the engine to round per channel
        assert np.array_equal(weights[name], dequantize(q, s, 1).T) and name + SCALES not in weights
        assert np.array_equal(np.asarray(mlp["down"][...][layer]), rounded[name])
        assert np.array_equal(np.asarray(mlp["down_scale"][...][layer]), rounded[name + SCALES])
        q, s = stored(f"blk.{layer}.ffn_gate.weight")  # gate: the even columns of gate/up
        name = f"layers.{layer}.gate_proj"
        assert np.array_equal(weights[name], dequantize(q, s, 1).T) and name + SCALES not in weights
        assert np.array_equal(np.asarray(mlp["gate_up"][...][layer][:, 0::2]), rounded[name])
    with_int8_dots(monkeypatch)
    with pytest.raises(ValueError, match="one scale per 32 weights, but quantization='w8a8' reads one per"):
        Engine(cfg, weights, tokenizer, EngineConfig(dtype="float32", quantization="w8a8", num_pages=64,
                                                     max_model_len=128))


def test_a_float_checkpoint_is_quantized_once_and_kept_in_the_cache(checkpoints, tmp_path, monkeypatch):
    """--quantization with a Hugging Face checkpoint: the int8 weights are the model's own
    quantization of the float ones, saved under $JAXSERVE_CACHE and restored from there; a changed
    checkpoint is quantized again."""
    import shutil
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    source = shutil.copytree(checkpoints("qwen3"), tmp_path / "qwen3")
    cfg, floats, _, _ = load_model(str(source))
    _, weights, tokenizer, _ = load_model(str(source), quantization="int8")
    kept = lambda: sorted(f for f in os.listdir(tmp_path / "cache") if f.startswith("qwen3-"))  # noqa: E731
    assert len(kept()) == 1 and kept()[0].endswith(f"-int8-{CACHE_FORMAT}")
    assert np.array_equal(weights["layers.1.gate_proj"], floats["layers.1.gate_proj"])  # the engine rounds the layers
    assert "layers.1.gate_proj.scales" not in weights
    q, s = quantize(floats["embed"], 1, GROUP)
    assert np.array_equal(weights["embed"], q) and np.array_equal(weights["embed.scales"], s)
    _, again, _, _ = load_model(str(source), quantization="int8")
    assert again.keys() == weights.keys() and all(np.array_equal(again[k], weights[k]) for k in weights)
    config = EngineConfig(dtype="float32", quantization="int8", num_pages=64, max_model_len=128)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 11)), list(range(20, 31))]
    loaded = Engine(cfg, again, tokenizer, config).generate(prompts, params)
    built = Engine(cfg, floats, tokenizer, config).generate(prompts, params)  # quantized as the model builds
    assert [o.token_ids for o in loaded] == [o.token_ids for o in built]
    os.utime(source / "config.json", ns=(0, 0))
    load_model(str(source), quantization="int8")
    assert len(kept()) == 2


def test_loaded_int8_weights_are_checked_against_their_scales(models):
    cfg, weights, _ = models["llama"]
    quantized = quantization.quantize_matrices(weights, "w8a8")  # every matrix int8
    with pytest.raises(ValueError, match="int8 matrix 'layers.0.q_proj' without its scales"):
        Transformer(cfg, {k: v for k, v in quantized.items() if k != "layers.0.q_proj.scales"},
                    quant=Int8Dot("int8", "float32", 0, GROUP))
    with pytest.raises(ValueError, match="scales 'final_norm.scales' belong to no matrix"):
        Transformer(cfg, quantized | {"final_norm.scales": np.ones(1, np.float16)}, quant=Int8Dot("int8", "float32"))
    with pytest.raises(ValueError, match="scales 'embed.scales' have shape"):
        Transformer(cfg, quantized | {"embed.scales": quantized["embed.scales"][:, :1].T}, quant=Int8Dot("int8", "float32"))
    with pytest.raises(ValueError, match="int8 weights need quantization='int8' or 'w8a8'"):
        Transformer(cfg, quantized)


def test_int8_gives_the_same_tokens_under_every_strategy_with_prefix_hits_and_leaks_no_page(models):
    cfg, weights, tokenizer = models["gemma3"]  # sliding windows too
    engine = Engine(cfg, weights, tokenizer, EngineConfig(dtype="float32", quantization="int8", max_slots=4,
                                                          page_size=8, num_pages=96, max_model_len=128))
    shared = list(range(3, 20))  # two full pages every prompt starts with
    work = [shared + [20 + i, 30 + i] for i in range(6)]
    params = [SamplingParams(max_tokens=4 + i % 3, temperature=0, ignore_eos=True) for i in range(6)]
    expected = [o.token_ids for o in engine.generate(work, params)]
    for strategy in ("none", "static", "dynamic", "continuous", "paged"):
        other = engine.with_strategy(strategy, batch_size=3, max_batch_delay_ms=0.0)
        assert [o.token_ids for o in other.generate(work, params)] == expected, strategy
        stats = other.stats()
        assert stats["running"] == stats["waiting"] == stats["used_pages"] == 0, strategy
    assert engine.stats()["prefix_cache_hits"] > 0
