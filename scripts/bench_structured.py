"""Structured output on one engine: throughput of constrained streams against the same streams
unconstrained, mask time per step, and validity over a set of schemas and regexes.

    python scripts/bench_structured.py --streams 16 --max-tokens 128 --json docs/bench_structured.json

1. Throughput. `--streams` prompts, each constrained by one of the JSON schemas below (sampled at
   temperature 0.7, seeded), run together; then the same prompts unconstrained, each forced (by
   `ignore_eos`) to the length its constrained twin reached, so both runs generate the same tokens
   per stream and differ only in the constraint. The two alternate `--reps` times; the medians of
   output tokens/s are reported, with their ratio and the host's mask time per step (from
   `Engine.stats()`).
2. Validity. Every schema (20+: nested objects, arrays with bounds, enums, anyOf, numbers with
   bounds, required and optional fields, string patterns) and every regex (10) runs
   `--samples` times; an output that ends with `stop` must parse and validate (`jsonschema`) or
   match (`re.fullmatch`); one cut by max_tokens ends with `length` and is counted apart.
Every step shape is compiled by `warmup()` first, and the compiles during the runs are reported
(they must be 0).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import jsonschema

from jaxserve import Engine, EngineConfig, SamplingParams, StructuredOutputs

NAME = {"type": "string", "minLength": 1, "maxLength": 20}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"name": NAME, "address": {"type": "object", "properties": {
        "street": {"type": "string", "maxLength": 30}, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"]}}, "required": ["name", "address"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}]}},
     "required": ["value"]},
    {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60}},
     "required": ["celsius"]},
    {"type": "object", "properties": {"count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1000}},
     "required": ["count"]},
    {"type": "object", "properties": {"title": NAME, "subtitle": NAME, "year": {"type": "integer"}},
     "required": ["title"], "additionalProperties": False},
    {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
     "required": ["phone"]},
    {"type": "object", "properties": {"active": {"type": "boolean"}, "note": {"type": "null"}},
     "required": ["active", "note"]},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "number"}, "y": {"type": "number"}},
     "required": ["kind", "x", "y"]},
    {"type": "object", "properties": {"code": {"type": "string", "minLength": 4, "maxLength": 4}}, "required": ["code"]},
    {"type": "object", "properties": {"stars": {"enum": [1, 2, 3, 4, 5]}}, "required": ["stars"]},
    {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"circle": {"type": "number", "minimum": 0}}, "required": ["circle"],
         "additionalProperties": False},
        {"type": "object", "properties": {"square": {"type": "number", "minimum": 0}}, "required": ["square"],
         "additionalProperties": False}]}}, "required": ["shape"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"}},
     "required": ["email"]},
    {"type": "object", "properties": {"id": {"type": "integer"}, "label": NAME, "score": {"type": "number"}},
     "required": ["id"], "additionalProperties": False},
    {"type": "object", "properties": {"nickname": {"type": ["string", "null"], "maxLength": 15}},
     "required": ["nickname"]},
    {"type": "object", "properties": {"parent": {"type": ["integer", "null"]}}, "required": ["parent"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "array", "maxItems": 2, "items": {"type": "boolean"}}}, "required": ["c"]}}, "required": ["b"]}},
     "required": ["a"]},
    {"type": "array", "minItems": 2, "maxItems": 4, "items": {"type": "integer", "minimum": 0, "maximum": 99}},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {
        "type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"],
     "additionalProperties": False},
]
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no)", r"[A-Z][a-z]{2,8}", r"20[0-9]{2}-[01][0-9]-[0-3][0-9]",
           r"[a-z]{1,8}@[a-z]{1,8}\.com", r"\$[0-9]{1,4}\.[0-9]{2}", r"(red|green|blue)( (red|green|blue)){0,2}",
           r"#[0-9a-f]{6}", r"[0-9]+(\.[0-9]+)?", r"[A-Z]{2}[0-9]{4}"]
PROMPTS = ["Describe a person as JSON:", "A product in the catalogue:", "The weather today, as data:",
           "Here is the record:", "JSON for a city:", "An answer in JSON:", "The order details:", "Output:"]


def constrained(spec: dict, max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=seed,
                          structured_outputs=StructuredOutputs(**spec))


def throughput(engine: Engine, args) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.streams)]
    specs = [dict(json=SCHEMAS[i % len(SCHEMAS)]) for i in range(args.streams)]
    runs = {"constrained": [], "unconstrained": []}
    mask_per_step = []
    for rep in range(args.reps):
        params = [constrained(s, args.max_tokens, 1000 * rep + i) for i, s in enumerate(specs)]
        before = engine.stats()
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
        after = engine.stats()
        tokens = [len(o.token_ids) for o in outs]
        runs["constrained"].append(sum(tokens) / elapsed)
        steps = after["structured_output_mask_steps"] - before["structured_output_mask_steps"]
        mask_per_step.append((after["structured_output_mask_seconds"] - before["structured_output_mask_seconds"])
                             / max(steps, 1))
        # The same streams unconstrained, each to the length its constrained twin reached.
        plain = [SamplingParams(max_tokens=n, temperature=0.7, seed=1000 * rep + i, ignore_eos=True)
                 for i, n in enumerate(tokens)]
        start = time.perf_counter()
        outs = engine.generate(prompts, plain)
        runs["unconstrained"].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
        print(f"rep {rep}: constrained {runs['constrained'][-1]:.1f} tok/s, unconstrained "
              f"{runs['unconstrained'][-1]:.1f} tok/s, mask {1000 * mask_per_step[-1]:.2f} ms/step", flush=True)
    c, u = statistics.median(runs["constrained"]), statistics.median(runs["unconstrained"])
    return {"streams": args.streams, "constrained_tok_s": c, "unconstrained_tok_s": u, "ratio": c / u,
            "mask_ms_per_step": 1000 * statistics.median(mask_per_step), "runs": runs}


def validity(engine: Engine, args) -> dict:
    cases = [("schema", i, dict(json=s)) for i, s in enumerate(SCHEMAS)] + \
            [("regex", i, dict(regex=r)) for i, r in enumerate(REGEXES)]
    prompts, params, which = [], [], []
    for kind, i, spec in cases:
        for k in range(args.samples):
            prompts.append(PROMPTS[(i + k) % len(PROMPTS)])
            params.append(constrained(spec, args.validity_max_tokens, 7 * i + k))
            which.append((kind, i))
    outs = engine.generate(prompts, params)
    valid = 0
    failures, cut = [], []
    for (kind, i), out in zip(which, outs):
        if out.finish_reason == "length":
            cut.append({"kind": kind, "index": i, "tail": out.text[-40:]})
            continue
        try:
            if kind == "schema":
                jsonschema.validate(json.loads(out.text), SCHEMAS[i])
            elif not re.fullmatch(REGEXES[i], out.text):
                raise ValueError("no full match")
            valid += 1
        except Exception as e:  # noqa: BLE001 — reported
            failures.append({"kind": kind, "index": i, "text": out.text, "error": str(e)[:200]})
    finished = len(outs) - len(cut)
    return {"schemas": len(SCHEMAS), "regexes": len(REGEXES), "outputs": len(outs), "finished": finished,
            "valid": valid, "valid_share": valid / finished if finished else None, "cut_by_max_tokens": len(cut),
            "failures": failures, "cut": cut}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: Gemma 3 270M)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128, help="per constrained stream (throughput)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--samples", type=int, default=2, help="outputs per schema and per regex (validity)")
    p.add_argument("--validity-max-tokens", type=int, default=192)
    p.add_argument("--dtype", default=EngineConfig.dtype)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-validity", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    slots = max(args.streams, 32)
    engine = Engine.from_pretrained(args.model, EngineConfig(max_slots=slots, max_model_len=512, dtype=args.dtype,
                                                             max_num_batched_tokens=max(256, slots)))
    print(engine.describe(), flush=True)
    start = time.perf_counter()
    engine.prepare_structured_output()
    engine.warmup(progress=True)
    print(f"warm-up {time.perf_counter() - start:.1f} s", flush=True)
    compiles = engine.stats()["num_compiles"]
    result = {"model": engine.model_name}
    if not args.skip_validity:
        result["validity"] = validity(engine, args)
        v = result["validity"]
        print(f"validity: {v['valid']}/{v['finished']} finished outputs valid ({v['cut_by_max_tokens']} cut by "
              f"max_tokens) over {v['schemas']} schemas and {v['regexes']} regexes", flush=True)
        for f in v["failures"]:
            print("  INVALID", f)
    if not args.skip_throughput:
        result["throughput"] = t = throughput(engine, args)
        print(f"{t['streams']} streams: constrained {t['constrained_tok_s']:.1f} tok/s, unconstrained "
              f"{t['unconstrained_tok_s']:.1f} tok/s, ratio {t['ratio']:.3f}; mask {t['mask_ms_per_step']:.2f} ms "
              f"per step", flush=True)
    result["compiles_after_warmup"] = engine.stats()["num_compiles"] - compiles
    print(f"compiles after warm-up: {result['compiles_after_warmup']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
