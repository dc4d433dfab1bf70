"""What the engine process's messages cost to encode and decode: pickle (what jaxserve sends)
against msgpack (msgspec, which vLLM V1 moved to because it cannot run code on load), on the
messages of a busy server.

    pip install msgspec   # for this comparison only; jaxserve does not use it
    python scripts/bench_ipc.py --slots 32 --prompts 16 --prompt-len 256

Messages, as `jaxserve/engine/core_process.py` and `engine_client.py` build them:
- a step's outputs: ("batch", replies, one tuple per running request with its new token id, the
  engine's stats), the message sent every step;
- the same with logprobs (5 alternatives per token) for every request;
- an `add` command: a payload of prompts (token ids) with their sampling parameters (as a dict
  for msgpack, which cannot carry the dataclass; pickle carries it as is).
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import statistics
import time

from jaxserve.engine.batching.sampling_params import SamplingParams


def step_message(slots: int, logprobs: bool) -> tuple:
    def per_token(i):  # objects of their own: pickle would send a shared one once
        return [{"logprob": -0.25 - i, "top": [(100 + i + k, -0.5 - k) for k in range(5)]}] if logprobs else None
    outputs = [(f"cmpl-{i:032x}-0", [1000 + i], per_token(i), None, 64, None) for i in range(slots)]
    stats = {"running": slots, "waiting": 3, "free_pages": 1200, "cached_pages": 800, "used_pages": 1640,
             "total_pages": 3640, "kv_groups": [{"window": w, "used": 100, "cached": 50, "free": 400}
                                                for w in (512,) * 5 + (None,)],
             "prefix_cache_queries": 123456, "prefix_cache_hits": 65432, "num_compiles": 0, "tokens_run": 10**6,
             "tokens_computed": 10**6 + 5000, "num_preemptions": 2, "num_errors": 0, "num_steps": 40000,
             "structured_output_mask_seconds": 1.5, "structured_output_mask_steps": 900}
    return ("batch", [], outputs, stats)


def add_command(prompts: int, length: int, as_dict: bool) -> tuple:
    params = [SamplingParams(max_tokens=128, temperature=0.7, top_p=0.9, seed=i, stop=("\n\n",))
              for i in range(prompts)]
    return ("add", 17, [list(range(1000 + i, 1000 + i + length)) for i in range(prompts)],
            [dataclasses.asdict(q) if as_dict else q for q in params], "cmpl-x", 12.5, None)


def timed(encode, decode, message, reps: int) -> tuple[float, int]:
    """(median µs of an encode plus a decode, encoded bytes)."""
    data = encode(message)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        decode(encode(message))
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times), len(data)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=32, help="running requests in a step")
    p.add_argument("--prompts", type=int, default=16, help="prompts in one add command")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--reps", type=int, default=2000)
    args = p.parse_args(argv)
    import msgspec
    msgpack_encode, msgpack_decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder().decode

    def pickled(message):
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    cases = [("step outputs", step_message(args.slots, False), step_message(args.slots, False)),
             ("step outputs, logprobs", step_message(args.slots, True), step_message(args.slots, True)),
             ("add command", add_command(args.prompts, args.prompt_len, False),
              add_command(args.prompts, args.prompt_len, True))]
    print(f"| message | pickle µs | pickle bytes | msgpack µs | msgpack bytes |\n|---|---|---|---|---|")
    for name, for_pickle, for_msgpack in cases:
        pt, pb = timed(pickled, pickle.loads, for_pickle, args.reps)
        mt, mb = timed(msgpack_encode, msgpack_decode, for_msgpack, args.reps)
        print(f"| {name} | {pt:.1f} | {pb} | {mt:.1f} | {mb} |")


if __name__ == "__main__":
    main()
