"""The real default model, Gemma 3 270M, against Hugging Face transformers on the same GGUF.

The engine runs in a subprocess that compiles at XLA's default optimization level, as users get
it: the suite's `--xla_backend_optimization_level=0` (tests/conftest.py) compiles tiny models
faster, but makes this model's steps about 4x slower. transformers loads and generates in this
process meanwhile. Slow (about a minute): marked `slow`, and run in CI like everything else.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow

LOGIT_TOL = 5e-4  # float32 on both sides (measured 6e-5 against logits up to 29)
NEAR_TIE = 0.05
TOKENS = 32  # generated per prompt, and compared up to the first near tie
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of"]
LOGITS_TEXT = PROMPTS[2] + " there lived an old clockmaker who"  # a prompt, then 4 tokens one step each


@pytest.fixture(scope="module", autouse=True)
def engine_process(tmp_path_factory):
    """The engine side of every test (`run_engine`), started before transformers loads; its output
    goes to a file, so it never waits on a full pipe while this process is busy."""
    folder = tmp_path_factory.mktemp("gemma3_engine")
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", ""))
    with open(folder / "engine.log", "w") as log:
        proc = subprocess.Popen([sys.executable, __file__, str(folder / "outputs.npz")], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    yield proc, folder
    proc.kill()


@pytest.fixture(scope="module")
def engine(engine_process):
    """What the subprocess wrote: prompt ids, float32 and bfloat16 greedy tokens (float32's with
    their top-2 logprobs) and the logits of LOGITS_TEXT through the paged pool in both dtypes."""
    proc, folder = engine_process
    assert proc.wait(timeout=900) == 0, (folder / "engine.log").read_text()[-6000:]
    return dict(np.load(folder / "outputs.npz"))


def test_logits_close_to_hugging_face(hf_gemma3, engine):
    tokens, got = engine["logits_tokens"], engine["float32_logits"]
    with torch.no_grad():
        expected = hf_gemma3(torch.tensor(tokens[None], dtype=torch.long)).logits[0].numpy()
    err = np.abs(got - expected).max()
    assert err < LOGIT_TOL, f"max |logit difference| {err}"
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_greedy_generation_matches_hugging_face_up_to_first_near_tie(hf_gemma3, engine):
    """One left-padded batch through transformers' generate, row by row against the engine."""
    prompts = [ids[ids >= 0] for ids in engine["prompt_ids"]]  # -1 pads the rows of the array
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p.tolist() for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        ref = hf_gemma3.generate(ids, attention_mask=mask, max_new_tokens=TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    compared = 0
    for row, prompt in enumerate(PROMPTS):
        ref_tokens = ref.sequences[row, width:].tolist()
        for step, scores in enumerate(ref.scores):
            top2 = torch.topk(scores[row], 2).values
            if (top2[0] - top2[1]).item() < NEAR_TIE:
                break  # float rounding may legitimately flip a near tie
            assert engine["float32_tokens"][row, step] == ref_tokens[step], f"{prompt!r}: token {step} differs"
            compared += 1
    assert compared >= 4 * 16, f"only {compared} tokens compared before near ties"


def test_bfloat16_tracks_float32_up_to_the_first_near_tie(engine):
    """bfloat16 weights (the default on accelerators and on CPUs with bfloat16 dot instructions;
    asked for here, so every CPU runs it) against the float32 engine: the same greedy tokens up to
    the first position where float32's top-2 log-probability margin is under 0.1."""
    compared = 0
    for prompt, ref, top2, got in zip(PROMPTS, engine["float32_tokens"], engine["float32_top2"],
                                      engine["bfloat16_tokens"]):
        for step, token in enumerate(ref):
            if top2[step, 0] - top2[step, 1] < 0.1:
                break
            assert got[step] == token, f"{prompt!r}: token {step} differs before any near tie"
            compared += 1
    print(f"bfloat16 vs float32: {compared} of {5 * TOKENS} greedy tokens compared before near ties, all equal")
    assert compared >= 5 * 8, f"only {compared} tokens compared before near ties"


def test_bfloat16_logits_stay_close_to_float32(engine):
    f32, bf16 = engine["float32_logits"], engine["bfloat16_logits"]
    err = np.abs(bf16 - f32).max()
    print(f"largest logit difference, bfloat16 weights vs float32: {err:.3f} (logits up to {np.abs(f32).max():.1f})")
    assert err < 0.1 * np.abs(f32).max()


def run_engine(out: str) -> None:
    """The subprocess: every engine output the tests compare, saved to `out`."""
    import gc

    from model_helpers import paged_logits

    from jaxserve import Engine, EngineConfig, SamplingParams
    from jaxserve.model.loader import load_model
    from jaxserve.model.transformer import Transformer

    # A page holds 3 of the 18 layers (6 KV-cache groups): 480 pages are the memory 80 were.
    config = EngineConfig(max_slots=8, max_model_len=256, num_pages=480)
    results = {}
    float32 = Engine.from_pretrained(None, config.replace(dtype="float32"))
    outputs = float32.generate(PROMPTS, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=2))
    results["float32_tokens"] = np.array([o.token_ids for o in outputs])
    results["float32_top2"] = np.array([[[lp for _, lp in step["top"][:2]] for step in o.logprobs] for o in outputs])
    prompts = [float32.tokenizer.encode(p) for p in PROMPTS]
    results["prompt_ids"] = np.array([p + [-1] * (max(map(len, prompts)) - len(p)) for p in prompts])
    tokens = np.array(float32.tokenizer.encode(LOGITS_TEXT), np.int32)
    results["logits_tokens"] = tokens
    del float32
    gc.collect()
    model_config, weights = load_model(None)[:2]
    for dtype in ("float32", "bfloat16"):
        model = Transformer(model_config, weights, dtype=dtype)
        results[f"{dtype}_logits"] = paged_logits(model, tokens, prompt_len=len(tokens) - 4)
    del model, weights
    gc.collect()
    bfloat16 = Engine.from_pretrained(None, config.replace(dtype="bfloat16"))
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    results["bfloat16_tokens"] = np.array([o.token_ids for o in bfloat16.generate(PROMPTS, greedy)])
    np.savez(out, **results)


if __name__ == "__main__":
    run_engine(sys.argv[1])
