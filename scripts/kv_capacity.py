"""How many long sequences the KV pool holds at once, with every layer keeping the whole sequence
(one KV-cache group, as before the hybrid allocator) and with sliding-window layers keeping only
their window: the scheduler alone, with a fake runner, in seconds, no device.

    python scripts/kv_capacity.py --context 8192 --kv-cache-mb 1024 --dtype-bytes 2

For each layout it reports the largest number of sequences of `--context` prompt tokens (plus
`--output` generated ones) that run together without a preemption, and the KV bytes they hold
per token at the end. Shapes default to Gemma 3 270M (18 layers, 15 local with a 512-token window,
one kv head of 256).
"""

from __future__ import annotations

import argparse

import numpy as np

from jaxserve.engine.batching import BlockManager, Request, SamplingParams, Scheduler, SchedulerConfig, make_policy
from jaxserve.model.config import ModelConfig
from jaxserve.model.kv_groups import kv_groups


def run(windows, layers_per_page, args, n: int) -> tuple[bool, float]:
    """(whether n sequences ran together without a preemption, the KV bytes they held per token
    when they all ran, at most)."""
    page_bytes = 2 * layers_per_page * args.kv_heads * args.page_size * args.head_dim * args.dtype_bytes
    blocks = BlockManager(args.kv_cache_mb * 2**20 // page_bytes, args.page_size, enable_caching=False,
                          num_groups=len(windows))
    sched = Scheduler(SchedulerConfig(max_slots=n, max_model_len=args.context + args.output,
                                      max_num_batched_tokens=max(n, args.budget), kv_group_windows=windows),
                      blocks, make_policy("paged"))
    rng = np.random.default_rng(0)
    for i in range(n):
        sched.add(Request(f"r{i}", rng.integers(10, 1000, args.context).tolist(),
                          SamplingParams(max_tokens=args.output, ignore_eos=True), seed=0, arrival_time=0.0))
    per_token, together = 0.0, False
    while sched.has_unfinished():
        s = sched.schedule()
        sched.update(s, np.full(len(s.num_tokens), 7))
        if len(sched.running) == n:
            together = True
            per_token = max(per_token, blocks.used_pages * page_bytes / sum(r.num_tokens for r in sched.running))
    return together and not sched.num_preemptions, per_token


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--kv-cache-mb", type=int, default=1024)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--global-every", type=int, default=6, help="one global layer in this many")
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=256)
    args = p.parse_args()
    layer_windows = [None if (i + 1) % args.global_every == 0 else args.window for i in range(args.layers)]
    cfg = ModelConfig(vocab_size=1000, hidden_size=8, intermediate_size=8, num_layers=args.layers, num_heads=1,
                      num_kv_heads=args.kv_heads, head_dim=args.head_dim, layer_windows=tuple(layer_windows))
    groups = kv_groups(cfg)
    print("| layout | sequences of {} tokens together, no preemption | KV bytes held per token |".format(args.context))
    print("|---|---|---|")
    for name, windows, per_page in (("every layer keeps the sequence", (None,), args.layers),
                                    ("sliding layers keep their window", groups.windows, groups.layers_per_page)):
        n, per_token = 0, float("nan")
        while True:
            fits, held = run(windows, per_page, args, n + 1)
            if not fits:
                break
            n, per_token = n + 1, held
        print(f"| {name} | {n} | {per_token:.0f} |", flush=True)


if __name__ == "__main__":
    main()
