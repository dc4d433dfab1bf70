"""The real default model, Gemma 3 270M, against Hugging Face transformers on the same GGUF.

Slow (about a minute): marked `slow`, and run in CI like everything else.
"""

import numpy as np
import pytest
import torch
from model_helpers import paged_logits

from jaxserve import Engine, EngineConfig, SamplingParams
from jaxserve.model.loader import load_model
from jaxserve.model.transformer import Transformer

pytestmark = pytest.mark.slow

LOGIT_TOL = 5e-4  # float32 on both sides (measured 6e-5 against logits up to 29)
NEAR_TIE = 0.05
TOKENS = 32  # generated per prompt, and compared up to the first near tie
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def weights():
    return load_model(None)[:2]  # (config, float32 weights)


@pytest.fixture(scope="module")
def engine():
    # A page holds 3 of the 18 layers (6 KV-cache groups): 480 pages are the memory 80 were.
    return Engine.from_pretrained(None, EngineConfig(max_slots=8, max_model_len=256, num_pages=480, dtype="float32"))


@pytest.fixture(scope="module")
def float32_logits(engine, weights):
    """(tokens, float32 logits through the paged pool: a prompt, then 4 tokens one chunk each)."""
    tokens = np.array(engine.tokenizer.encode(PROMPTS[2] + " there lived an old clockmaker who"), np.int32)
    return tokens, paged_logits(Transformer(*weights), tokens, prompt_len=len(tokens) - 4)


@pytest.fixture(scope="module")
def float32_outputs(engine):
    """The float32 engine's greedy outputs (32 tokens, top-2 logprobs), shared by two tests."""
    return engine.generate(PROMPTS, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=2))


def test_logits_close_to_hugging_face(hf_gemma3, float32_logits):
    tokens, got = float32_logits
    with torch.no_grad():
        expected = hf_gemma3(torch.tensor(tokens[None], dtype=torch.long)).logits[0].numpy()
    err = np.abs(got - expected).max()
    assert err < LOGIT_TOL, f"max |logit difference| {err}"
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_greedy_generation_matches_hugging_face_up_to_first_near_tie(engine, hf_gemma3, float32_outputs):
    compared = 0
    for prompt, out in zip(PROMPTS, float32_outputs):
        ids = torch.tensor([engine.tokenizer.encode(prompt)])
        with torch.no_grad():
            ref = hf_gemma3.generate(ids, max_new_tokens=TOKENS, do_sample=False, output_scores=True,
                                     return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        ref_tokens = ref.sequences[0, ids.shape[1]:].tolist()
        for step, scores in enumerate(ref.scores):
            top2 = torch.topk(scores[0], 2).values
            if (top2[0] - top2[1]).item() < NEAR_TIE:
                break  # float rounding may legitimately flip a near tie
            assert out.token_ids[step] == ref_tokens[step], f"{prompt!r}: token {step} differs"
            compared += 1
    assert compared >= 4 * 16, f"only {compared} tokens compared before near ties"


def test_default_dtype_tracks_float32_up_to_the_first_near_tie(float32_outputs):
    """bfloat16 weights (the default) against the float32 engine: the same greedy tokens up to the
    first position where float32's top-2 log-probability margin is under 0.1."""
    default = Engine.from_pretrained(None, EngineConfig(max_slots=8, max_model_len=256, num_pages=480))
    assert default.config.weights_dtype == "bfloat16"
    got = default.generate(PROMPTS, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    compared = 0
    for prompt, ref, out in zip(PROMPTS, float32_outputs, got):
        for step, (token, lp) in enumerate(zip(ref.token_ids, ref.logprobs)):
            if lp["top"][0][1] - lp["top"][1][1] < 0.1:
                break
            assert out.token_ids[step] == token, f"{prompt!r}: token {step} differs before any near tie"
            compared += 1
    print(f"default dtype vs float32: {compared} of {5 * TOKENS} greedy tokens compared before near ties, all equal")
    assert compared >= 5 * 8, f"only {compared} tokens compared before near ties"


def test_default_dtype_logits_stay_close_to_float32(weights, float32_logits):
    tokens, f32 = float32_logits
    bf16 = paged_logits(Transformer(*weights, dtype="bfloat16"), tokens, prompt_len=len(tokens) - 4)
    err = np.abs(bf16 - f32).max()
    print(f"largest logit difference, bfloat16 weights vs float32: {err:.3f} (logits up to {np.abs(f32).max():.1f})")
    assert err < 0.1 * np.abs(f32).max()
