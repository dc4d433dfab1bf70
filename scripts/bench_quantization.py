"""How far int8 weights move a model from its float weights: log-likelihood and next-token
agreement over a fixed text, and greedy tokens on ten prompts.

    python scripts/bench_quantization.py                     # Gemma 3 270M: int8 and w8a8 against bfloat16
    python scripts/bench_quantization.py --dtype float32 --modes int8

The text is the "Execution model" chapter of the Python Language Reference as CPython ships it
(`pydoc_data.topics`, the same words on every machine with this Python): its first `--tokens`
tokens. For each mode the model runs the whole text in one prefill (reference attention) and the
output layer gives every position's scores. Printed per mode against the float model in `--dtype`:
the text's log-likelihood (the sum of each next token's log-probability) and its relative
difference; the share of positions whose top-1 token is the float model's; and, on ten prompts of
32 greedy tokens, how many are equal to the float model's up to its first near tie (a top-2
log-probability margin under 0.1, where float rounding alone may flip the choice), each prompt a
request of its own. The text's thousands of rows run int8's converted dots; where the engine takes
integer dots here (measured at start-up), the row "int8, integer dots" runs them as its steps of
few rows do (the activations split per row, so each row's values are those of a one-row step), with the ten
prompts one at a time, and the "int8" row's prompts run together (10 rows: converted dots). For a
GGUF, first how far int8 moves each storage type's values (Q4_K and Q6_K are requantized from their
floats).
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pydoc_data.topics
from flax import nnx

from jaxserve import Engine, EngineConfig, SamplingParams
from jaxserve.engine.resources import resolve_quantization
from jaxserve.model.default_model import default_model_path
from jaxserve.model.loader import cache_root, load_model
from jaxserve.model.quantization import GROUP, OUTLIERS, dequantize, quantize, with_outliers
from jaxserve.model.transformer import Transformer
from jaxserve.model.weights import SCALES
from jaxserve.worker.calibration import INPUTS, prefill_hidden, rounded_layers

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of", "The largest planet in the solar system",
           "To make a cup of tea, first", "In 1492, Columbus", "The opposite of hot is", "SELECT name FROM users WHERE"]
NEAR_TIE, TOKENS, ROWS = 0.1, 32, 256
INTEGER = "int8, integer dots"  # int8 as its steps of up to `integer_rows` rows run it, where they are faster


def text_scores(model: Transformer, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(log-probability of each next token [n - 1], top-1 token at each position [n - 1])."""
    n = len(ids)
    hidden = prefill_hidden(model, ids)
    score = nnx.jit(lambda m, h, nxt: (jnp.take_along_axis(jax.nn.log_softmax(m.logits(h)), nxt[:, None], 1)[:, 0],
                                       jnp.argmax(m.logits(h), axis=-1)))
    logp, top = [], []
    targets = np.asarray(ids[1:] + [0], np.int32)
    for start in range(0, n, ROWS):
        rows = np.arange(start, start + ROWS) % n  # the last chunk wraps round: cut below
        lp, t = score(model, hidden[rows], jnp.asarray(targets[rows]))
        logp.append(np.asarray(lp)), top.append(np.asarray(t))
    return np.concatenate(logp)[:n - 1], np.concatenate(top)[:n - 1]


def greedy(engine: Engine, together: bool = False) -> list[list[tuple[int, float]]]:
    """Per prompt, (token, top-2 margin) of each greedy step: one request at a time, each decode
    step one row (int8's integer dots, where this machine has them), or `together`, 10 rows."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    outputs = engine.generate(PROMPTS, params) if together else [engine.generate(p, params)[0] for p in PROMPTS]
    return [[(t, step["top"][0][1] - step["top"][1][1]) for t, step in zip(o.token_ids, o.logprobs)]
            for o in outputs]


def equal_to_first_near_tie(ref: list[tuple[int, float]], got: list[tuple[int, float]]) -> bool:
    for (token, margin), (other, _) in zip(ref, got):
        if margin < NEAR_TIE:
            return True
        if token != other:
            return False
    return True


def gguf_requantization_error(path: str) -> dict[str, tuple[int, float, float]]:
    """Per GGUF storage type of the file's matrices: (tensors, relative RMS error, largest error in
    steps of its block's int8 scale) of int8 (a scale per 32 weights along the inputs) against the
    values the file stores."""
    import gguf
    totals: dict[str, list[float]] = {}
    for tensor in gguf.GGUFReader(path).tensors:
        if len(tensor.shape) != 2:
            continue
        stored = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)  # [out, in]
        q, scale = quantize(stored, 1, GROUP)
        err = dequantize(q, scale, 1) - stored
        steps = np.abs(err) / np.repeat(scale.astype(np.float32), stored.shape[1] // scale.shape[1], axis=1)
        t = totals.setdefault(tensor.tensor_type.name, [0, 0.0, 0.0, 0.0])
        t[0] += 1
        t[1] += float((err.astype(np.float64) ** 2).sum())
        t[2] += float((stored.astype(np.float64) ** 2).sum())
        t[3] = max(t[3], float(steps.max()))
    return {name: (int(n), (e / s) ** 0.5, worst) for name, (n, e, s, worst) in totals.items()}


def output_layer_error(path: str) -> tuple[str, float, float]:
    """(storage type, relative RMS error, largest error in steps of its row's int8 scale) of int8's
    output layer (`with_outliers`: a scale per output channel, its largest input channels in
    float32) against the values the file stores, for the tensor the output layer reads."""
    import gguf
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    tensor = tensors.get("output.weight", tensors["token_embd.weight"])
    stored = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)  # [V, D]
    q, scale, channels, kept = (np.asarray(a) for a in with_outliers(*quantize(stored, 1, GROUP), 1, OUTLIERS["int8"]))
    ours = dequantize(q, scale, 1)
    ours[:, channels] = kept
    err = ours - stored
    steps = np.abs(err) / scale.astype(np.float32)
    return tensor.tensor_type.name, float(np.sqrt((err.astype(np.float64) ** 2).sum() / (stored.astype(np.float64) ** 2).sum())), float(steps.max())


def layer_errors(cfg, weights: dict, rounded: dict) -> tuple[float, float]:
    """Relative RMS error of the layers' int8 matrices against the float `weights` (a GGUF's: the
    values it stores): (GPTQ's, as `rounded` holds them; rounding to the nearest, one scale per
    output channel). GPTQ trades a larger weight error for a smaller one in the layers' outputs."""
    totals = np.zeros(3)
    for name in (f"layers.{i}.{m}" for i in range(cfg.num_layers) for kind in INPUTS for m in kind):
        stored = np.asarray(weights[name], np.float64)
        gptq = dequantize(rounded[name], rounded[name + SCALES], 0) - stored
        nearest = dequantize(*quantize(stored, 0, None), 0) - stored
        totals += [(gptq ** 2).sum(), (nearest ** 2).sum(), (stored ** 2).sum()]
    return float(np.sqrt(totals[0] / totals[2])), float(np.sqrt(totals[1] / totals[2]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: Gemma 3 270M)")
    p.add_argument("--dtype", default="bfloat16", help="the float model's, and the int8 modes' activations")
    p.add_argument("--modes", default="int8,w8a8")
    p.add_argument("--tokens", type=int, default=2000)
    args = p.parse_args(argv)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print("CPU:", next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?"))
    path = args.model or default_model_path()
    if path.endswith(".gguf"):
        print("\n| stored as | matrices | int8's relative RMS error | largest error, in int8 steps |\n|---|---|---|---|")
        for qtype, (n, rms, worst) in sorted(gguf_requantization_error(path).items()):
            print(f"| {qtype} | {n} | {rms:.2e} | {worst:.2f} |")
        qtype, rms, worst = output_layer_error(path)
        print(f"| {qtype}, the output layer: a scale per output channel, {OUTLIERS['int8']} input channels in float32 "
              f"| 1 | {rms:.2e} | {worst:.2f} |")
    cfg, weights, tokenizer, name = load_model(args.model)
    ids = tokenizer.encode(pydoc_data.topics.topics["execmodel"])[:args.tokens]
    print(f"{name}; int8: {resolve_quantization(EngineConfig(dtype=args.dtype, quantization='int8'), cfg, None)[0].describe()}")
    print(f"{name}; text: the first {len(ids)} tokens of the Python Language Reference's 'Execution model'")
    modes = [None] + args.modes.split(",")
    scores, tokens = {}, {}
    for mode in modes:
        config = EngineConfig(dtype=args.dtype, quantization=mode, max_slots=16, max_model_len=256, num_pages=1024)
        quant = resolve_quantization(config, cfg, None)[0]  # the engine's dots on this machine
        model_weights = weights
        if mode == "int8":  # as the engine rounds them
            model_weights = rounded_layers(cfg, weights, tokenizer, cache_root())
            print("int8's layers, relative RMS error against the stored values: GPTQ %.2e, "
                  "rounded to the nearest %.2e" % layer_errors(cfg, weights, model_weights))
        model = Transformer(cfg, model_weights, jnp.dtype(args.dtype), quant=quant)
        scores[mode] = text_scores(model, ids)  # thousands of rows: converted dots
        engine = Engine(cfg, weights, tokenizer, config, model_name=name)
        integer = quant is not None and max(quant.integer_rows, quant.output_integer_rows) > 0
        tokens[mode] = greedy(engine, together=integer)
        if integer:  # int8's integer dots, which the engine's steps of up to `integer_rows` rows run
            tokens[INTEGER] = greedy(engine)
            # each row is split and scaled alone: the same values at any count
            model.quant = model.layers.attn.quant = model.layers.mlp.quant = dataclasses.replace(
                quant, integer_rows=len(ids), output_integer_rows=len(ids))
            scores[INTEGER] = text_scores(model, ids)
        del engine
    modes += [INTEGER] if INTEGER in scores else []
    ref_logp, ref_top = scores[None]
    print(f"\n| weights | log-likelihood | vs {args.dtype} | top-1 agreement | greedy prompts equal to the first near tie |")
    print("|---|---|---|---|---|")
    for mode in modes:
        logp, top = scores[mode]
        same = sum(equal_to_first_near_tie(r, g) for r, g in zip(tokens[None], tokens[mode]))
        print(f"| {mode or args.dtype} | {logp.sum():.1f} | {(logp.sum() - ref_logp.sum()) / abs(ref_logp.sum()):+.2%} "
              f"| {np.mean(top == ref_top):.2%} | {same} of {len(PROMPTS)} |", flush=True)


if __name__ == "__main__":
    main()
