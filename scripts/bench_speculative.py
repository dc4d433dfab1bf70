"""Speculative decoding with n-gram drafts (or --draft-model's) against none, side by side in one
process, on the default model (Gemma 3 270M) unless --model is given:

    python scripts/bench_speculative.py                      # K = 3: grounded, open, json, sampling
    python scripts/bench_speculative.py --k 5 --parts grounded
    python scripts/bench_speculative.py --parts grounded --draft-model PATH   # a draft model's drafts

- `grounded`: 8 prompts whose answer repeats the prompt (fix a paragraph's spelling, add type
  hints to a function), --new-tokens greedy tokens each, one request at a time; the two engines
  take turns prompt by prompt (A B, then B A). Output tokens/s of each, their ratio, whether the
  tokens are identical, and the acceptance (accepted / drafted tokens).
- `open`: the README benchmark's workload (--open-requests random-token prompts of 32-256
  tokens, 128 new tokens each, all at once, paged): the same figures.
- `batches`: the grounded prompts as one batch of B requests (the 8 repeated), for each B of
  --batches, 128 tokens each, drafting at every batch size (`max_batch` lifted): where a
  step's drafts stop paying, which `max_batch` should be below.
- `json`: 8 prompts that list records in prose and ask for them as JSON, the output constrained
  by a JSON schema (an array of objects with the same keys), --new-tokens greedy tokens each, one
  at a time: requests with a grammar draft what it accepts.
- `sampling`: --seeds requests at temperature 0.8 after one prompt that repeats itself, 8 new
  tokens each: each position's token for every seed, with and without speculation, the drafts
  kept, and a chi-square test of the two distributions per position (identical tokens: p = 1).
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np
from scipy.stats import chi2_contingency

from jaxserve import Engine, EngineConfig, SamplingParams, StructuredOutputs
from jaxserve.bench.server_process import cpu_model

PARAGRAPHS = [
    "The comittee met on tuesday to dicsuss the new libary budget. Most members agreed that the "
    "childrens section needed more books, but there was a long arguement about the cost of the "
    "new computers and wether the old ones could be repaired instead.",
    "Our garden was beautfiul this year. The tomatos grew taller then the fence, the beans "
    "climbed every pole we gave them, and the sunflowers turned there heads to follow the sun "
    "from morning untill evening.",
    "When the train finaly arrived, the platform was crowded with travellers carying heavy bags. "
    "A conductor walked along the carriages, checking tickets and anwsering questions about the "
    "delay, which had been caused by a fallen tree on the line.",
    "The recipe is simple: mix the flour and the butter untill the dough is smooth, let it rest "
    "for an hour in a cool place, then roll it out thinly, cut it into squares and bake them "
    "untill they are golden.",
]
FUNCTIONS = [
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    return sum((value - m) ** 2 for value in values) / len(values)\n",
    "def count_words(text):\n    counts = {}\n    for word in text.lower().split():\n"
    "        word = word.strip('.,;:!?')\n        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
    "def merge(left, right):\n    out = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n            out.append(left[i])\n            i += 1\n        else:\n"
    "            out.append(right[j])\n            j += 1\n    return out + left[i:] + right[j:]\n",
    "def clamp(value, low, high):\n    if value < low:\n        return low\n    if value > high:\n"
    "        return high\n    return value\n\n\ndef scale(values, factor):\n"
    "    return [clamp(v * factor, 0, 255) for v in values]\n",
]


def grounded_prompts() -> list[str]:
    return ([f"Fix the spelling mistakes in this paragraph.\n\nParagraph:\n{p}\n\nCorrected paragraph:\n"
             for p in PARAGRAPHS] +
            [f"Add type hints to this Python code.\n\n```python\n{f}```\n\nThe same code with type hints:\n\n```python\n"
             for f in FUNCTIONS])


BOOKS = [("Middlemarch", "George Eliot", 1871), ("Moby-Dick", "Herman Melville", 1851),
         ("Persuasion", "Jane Austen", 1817), ("Bleak House", "Charles Dickens", 1853),
         ("Walden", "Henry David Thoreau", 1854), ("Dracula", "Bram Stoker", 1897),
         ("The Odyssey", "Homer", -700), ("Frankenstein", "Mary Shelley", 1818)]
BOOKS_SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"}},
    "required": ["title", "author", "year"]}}


def json_prompts() -> list[str]:
    """Eight rotations of the list, in prose, each asking for it as JSON."""
    prose = [f"{title} was written by {author} in {year}." for title, author, year in BOOKS]
    return [f"{' '.join(prose[i:] + prose[:i])}\n\nThe same books as a JSON array of objects with the keys "
            f"title, author and year:\n" for i in range(len(prose))]


def spec_counts(engine: Engine) -> tuple[int, int]:
    s = engine.stats()
    return s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]


def timed(engine: Engine, prompts, params) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - start, [o.token_ids for o in outs]


def compare(name: str, engines: dict, runs: list) -> None:
    """runs: (prompts, params) run on both engines, taking turns."""
    seconds, tokens, steps, same = collections.Counter(), collections.Counter(), collections.Counter(), True
    drafted0 = spec_counts(engines["on"])
    for i, (prompts, params) in enumerate(runs):
        order = ("off", "on") if i % 2 == 0 else ("on", "off")
        got = {}
        for label in order:
            before = engines[label].num_steps
            took, got[label] = timed(engines[label], prompts, params)
            seconds[label] += took
            steps[label] += engines[label].num_steps - before
            tokens[label] += sum(map(len, got[label]))
        same &= got["on"] == got["off"]
    drafted, kept = (b - a for a, b in zip(drafted0, spec_counts(engines["on"])))
    rate = {label: tokens[label] / seconds[label] for label in ("off", "on")}
    step_ms = {label: 1000 * seconds[label] / steps[label] for label in ("off", "on")}
    print(f"| {name} | {rate['off']:.1f} | {rate['on']:.1f} | {rate['on'] / rate['off']:.2f}x | "
          f"{'yes' if same else 'NO'} | {kept} / {drafted} ({kept / max(drafted, 1):.0%}) | "
          f"{steps['off']} / {steps['on']} | {step_ms['off']:.1f} / {step_ms['on']:.1f} |", flush=True)


def sampling(engines: dict, seeds: int) -> None:
    """Every seed's first 8 tokens at temperature 0.8 after a prompt that repeats itself (so that
    drafts are made and kept from the second decode step on), with and without speculation."""
    prompt = "one two three four, one two three four, one two three four, one two three"
    params = [SamplingParams(max_tokens=8, temperature=0.8, seed=s, ignore_eos=True) for s in range(seeds)]
    chunk, tokens = engines["on"].config.speculative.max_batch, {}  # a batch that drafts
    drafted0 = spec_counts(engines["on"])
    for label in ("off", "on"):
        tokens[label] = [o.token_ids for start in range(0, seeds, chunk)
                         for o in engines[label].generate([prompt] * len(params[start:start + chunk]),
                                                          params[start:start + chunk])]
    drafted, kept = (b - a for a, b in zip(drafted0, spec_counts(engines["on"])))
    print(f"\nsampling: {seeds} seeds, 8 tokens each; drafts kept {kept} of {drafted} "
          f"({kept / max(drafted, 1):.0%}); all 8 tokens identical for "
          f"{sum(a == b for a, b in zip(tokens['off'], tokens['on']))} seeds\n")
    print("| token | distinct tokens | seeds with the same token | chi-square p |")
    print("|---|---|---|---|")
    for position in range(8):
        counts = {label: collections.Counter(t[position] for t in tokens[label]) for label in tokens}
        support = sorted(set(counts["off"]) | set(counts["on"]))
        table = np.array([[counts[label][t] for t in support] for label in ("off", "on")])
        p = 1.0 if (table[0] == table[1]).all() else chi2_contingency(table)[1]
        same = sum(a[position] == b[position] for a, b in zip(tokens["off"], tokens["on"]))
        print(f"| {position + 1} | {len(support)} | {same} of {seeds} | {p:.3f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--open-requests", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=2000)
    parser.add_argument("--batches", default="2,4,8,16,32")
    parser.add_argument("--parts", default="grounded,open,json,sampling")
    parser.add_argument("--draft-model", help="drafts from this checkpoint (method draft_model), not n-grams; "
                        "'default': Gemma 3 270M, the default model")
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.prompt_lookup_min}
    if args.draft_model:
        from jaxserve.model.default_model import default_model_path
        path = default_model_path() if args.draft_model == "default" else args.draft_model
        spec = {"method": "draft_model", "model": path, "num_speculative_tokens": args.k}
    engines = {label: Engine.from_pretrained(args.model, EngineConfig(speculative=spec if label == "on" else None))
               for label in ("off", "on")}
    for engine in engines.values():
        engine.warmup()
    parts = args.parts.split(",")
    print(f"CPU: {cpu_model()}; model {engines['on'].model_name}; speculative {spec}\n")
    print("| workload | off tok/s | on tok/s | on / off | same tokens | accepted / drafted | steps off / on | "
          "ms a step off / on |")
    print("|---|---|---|---|---|---|---|---|")
    if "grounded" in parts:
        greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0.0)
        compare("grounded: 8 prompts, one at a time", engines, [([p], greedy) for p in grounded_prompts()])
    if "open" in parts:
        rng = np.random.default_rng(0)
        vocab = engines["on"].model_config.vocab_size
        prompts = [rng.integers(1000, min(vocab, 200_000), size=rng.integers(32, 257)).tolist()
                   for _ in range(args.open_requests)]
        params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
        compare(f"open: {args.open_requests} random prompts at once", engines, [(prompts, params)] * 2)
    if "json" in parts:
        constrained = SamplingParams(max_tokens=args.new_tokens, temperature=0.0,
                                     structured_outputs=StructuredOutputs(json=BOOKS_SCHEMA))
        compare("json: 8 prompts, one at a time", engines, [([p], constrained) for p in json_prompts()])
    if "batches" in parts:
        lifted = {"off": engines["off"],
                  "on": engines["on"].with_strategy("paged", speculative={**spec, "max_batch": 1024})}
        greedy = SamplingParams(max_tokens=128, temperature=0.0)
        for b in map(int, args.batches.split(",")):
            prompts = (grounded_prompts() * b)[:b]
            compare(f"grounded, a batch of {b}, drafting", lifted, [(prompts, greedy)] * 2)
    if "sampling" in parts:
        sampling(engines, args.seeds)


if __name__ == "__main__":
    main()
