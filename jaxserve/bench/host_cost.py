"""What one engine step costs the host: the CPU time of the thread that calls `Engine.step()`, at a
given number of decoding sequences, on a tiny model under a long `max_model_len`.

    python -m jaxserve.bench.host_cost --sequences 1,8,64,256 --context 600 --max-model-len 32768

XLA runs a step's compute on threads of its own, and waiting for the sampled tokens costs no CPU,
so the stepping thread's CPU time is the engine's host work: scheduling, building the inputs,
dispatching, committing. The step's wall time is printed beside it; on a CPU it is mostly XLA's
attention. The model is a random Llama (6 layers, hidden 64 unless told) whose context is
`--max-model-len`, so the block tables are as wide as the default 32k context makes them. Only
the public API and the model's modules are used (but by `--breakdown`, which times the phases of
a step through this commit's internals), so this file also runs against older commits
(`PYTHONPATH=old-checkout python jaxserve/bench/host_cost.py`), side by side.

`--bookkeeping` times the host's part alone, with no device (schedule, build the inputs,
advance, commit, one after another): stable to a few percent, where a step's CPU time beside
XLA's compute on the same cores drifts by a third between runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import subprocess
import sys
import time

import jax
import numpy as np

from jaxserve import Engine, EngineConfig, SamplingParams
from jaxserve.model.config import ModelConfig
from jaxserve.model.weights import expected_shapes

VOCAB = 1024


def tiny_engine(sequences: int, context: int, steps: int, max_model_len: int, layers: int, hidden: int,
                decode_steps: int = 1, sliding_window: int | None = None) -> Engine:
    """A random Llama of `layers` x `hidden` with a context of `max_model_len`, and a KV pool that
    holds `sequences` sequences of `4 context + steps` tokens (the first ones decode while the last
    ones prefill), and one of max_model_len, as the engine asks. Its steps run up to 4 tokens per
    sequence, so that the prompts are in within a few hundred steps. With `sliding_window`, five
    layers in six see only that window, as in Gemma 3 (six KV-cache groups, five of them sliding)."""
    windows = None if sliding_window is None else tuple(
        None if (i + 1) % 6 == 0 else sliding_window for i in range(layers))
    cfg = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4,
                      max_position_embeddings=max_model_len, eos_token_ids=(2,), layer_windows=windows)
    rng = np.random.default_rng(0)
    weights = {name: (rng.standard_normal(shape) * 0.05 + (1.0 if "norm" in name else 0.0)).astype(np.float32)
               for name, shape in expected_shapes(cfg).items()}
    budget = max(256, 4 * sequences)
    per_sequence = -(-(4 * context + steps + 1) // 16) + 1
    if sliding_window is not None:  # each sliding group holds the window and what a step can reach
        per_sequence += 5 * (-(-(sliding_window + budget) // 16) + 1)
    pages = max(sequences * per_sequence, max_model_len // 16 + 1) + 1
    several = {"decode_steps": decode_steps} if decode_steps > 1 else {}  # older commits lack the field
    config = EngineConfig(max_slots=sequences, num_pages=pages, max_num_batched_tokens=budget,
                          dtype="float32", max_model_len=max_model_len, **several)
    return Engine(cfg, weights, None, config, model_name=f"random llama {layers}x{hidden}")


# The phases of a step, as `--breakdown` times them: (label, owner of the method, method), nested
# ones after the phase that calls them (their time is taken out of it).
PHASES = (("schedule", "scheduler", "schedule"), ("build inputs", "core", "_build"),
          ("dispatch", "runner", "dispatch"), ("  pack inputs", "runner", "step_inputs"),
          ("advance", "scheduler", "advance"), ("collect tokens", "runner", "collect"),
          ("commit", "scheduler", "commit"), ("outputs", "outputs", "apply_stop_strings"))


def time_phases(engine: Engine) -> dict[str, float]:
    """Wraps the methods of `PHASES` on this engine's objects so that each adds the stepping
    thread's CPU seconds to the returned totals (a nested phase's are also its caller's)."""
    totals: dict[str, float] = collections.defaultdict(float)
    owners = {"scheduler": engine.scheduler, "core": engine.core, "runner": engine.core.runner,
              "outputs": engine.outputs}
    for label, owner, name in PHASES:
        method = getattr(owners[owner], name)

        def timed(*args, _method=method, _label=label, **kwargs):
            start = time.thread_time()
            try:
                return _method(*args, **kwargs)
            finally:
                totals[_label] += time.thread_time() - start
        setattr(owners[owner], name, timed)
    return totals


def start_decoding(engine: Engine, sequences: int, context: int, steps: int) -> None:
    """Starts `sequences` requests of `context` prompt tokens and runs every prefill, then three
    decode steps: every sequence decodes from here on, for `steps` steps at least."""
    rng = np.random.default_rng(1)
    params = SamplingParams(max_tokens=min(3 * context + steps, engine.max_model_len - context), temperature=0,
                            ignore_eos=True)
    for _ in range(sequences):
        engine.add_request(rng.integers(3, VOCAB, context).tolist(), params)
    while engine.scheduler.waiting or any(r.num_uncomputed_tokens > 1 for r in engine.scheduler.running):
        engine.step()  # prefill chunks (and the programs they compile)
    for _ in range(3):
        engine.step()  # every decode program compiled, and the steps overlapping as they will
    assert len(engine.scheduler.running) == sequences, "a sequence finished before the steps were timed"


def measure_bookkeeping(engine: Engine, sequences: int, context: int, steps: int,
                        idle_ms: float = 0.0) -> dict[str, float]:
    """The host's bookkeeping of `steps` decode steps with no device at all: schedule, build the
    inputs, advance, commit (a constant token for every sequence), one after another on this
    thread. Per phase, the minimum and the median us of a step: without XLA's compute on the
    same cores these are stable to a few percent, where `measure`'s drift by 30% (docs/host.md).
    With `idle_ms`, the thread sleeps that long before each step, as the engine's waits for a
    step's tokens: what the same work costs once its caches have cooled.
    The engine's K/V no longer match its requests afterwards: they are aborted."""
    start_decoding(engine, sequences, context, steps)
    scheduler, clock, times = engine.scheduler, time.thread_time_ns, collections.defaultdict(list)
    tokens = np.full(sequences, 3, np.int32)
    for _ in range(steps):
        if idle_ms:
            time.sleep(idle_ms / 1e3)
        t0 = clock()
        schedule = scheduler.schedule()
        t1 = clock()
        engine.core._build(schedule)
        t2 = clock()
        scheduler.advance(schedule)
        t3 = clock()
        scheduler.commit(schedule, tokens)
        t4 = clock()
        for label, begin, end in (("schedule", t0, t1), ("build inputs", t1, t2), ("advance", t2, t3),
                                  ("commit", t3, t4), ("all", t0, t4)):
            times[label].append((end - begin) / 1e3)
    for request in list(scheduler.running):
        engine.abort(request.request_id)
    return {label: (min(us), statistics.median(us)) for label, us in times.items()}


def measure(engine: Engine, sequences: int, context: int, steps: int, trace: str | None = None,
            breakdown: bool = False) -> dict[str, float]:
    """Starts `sequences` decoding sequences (`start_decoding`), then times `steps` calls of
    `Engine.step()`: the stepping thread's CPU ms and the wall ms per call (medians), and the
    tokens each sequence decoded per call (more than one with `decode_steps`); with `trace`, a
    jax.profiler trace of those steps goes to that folder."""
    start_decoding(engine, sequences, context, steps)
    cpu, wall = [], []
    phases = time_phases(engine) if breakdown else {}
    decoded = sum(len(r.output_token_ids) for r in engine.scheduler.running)
    with jax.profiler.trace(trace) if trace else contextlib.nullcontext():
        for _ in range(steps):
            c0, w0 = time.thread_time(), time.perf_counter()
            engine.step()
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - w0)
    decoded = sum(len(r.output_token_ids) for r in engine.scheduler.running) - decoded
    for request in list(engine.scheduler.running):
        engine.abort(request.request_id)
    row = {"cpu_ms": statistics.median(cpu) * 1e3, "wall_ms": statistics.median(wall) * 1e3,
           "tokens_per_call": decoded / (sequences * steps)}
    if breakdown:  # means per call; dispatch without the packing it calls; "other": the rest of step()
        phases["dispatch"] -= phases["  pack inputs"]
        row["phases"] = {label: phases[label] / steps * 1e3 for label, _, _ in PHASES}
        row["phases"]["other"] = sum(cpu) / steps * 1e3 - sum(v for k, v in row["phases"].items()
                                                              if not k.startswith(" "))
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequences", default="1,8,64,256", help="comma-separated counts of decoding sequences")
    p.add_argument("--context", type=int, default=600, help="prompt tokens of each sequence")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed at each count")
    p.add_argument("--max-model-len", default="32768", help="comma-separated contexts of the model")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=1, help="EngineConfig.decode_steps (this commit's)")
    p.add_argument("--sliding-window", type=int, default=None, metavar="W",
                   help="five layers in six attend to the last W tokens only, as in Gemma 3 (W 512 there)")
    p.add_argument("--trace", default=None, metavar="DIR", help="a jax.profiler trace of the timed steps, per "
                   "configuration in DIR/SEQUENCES-MAX_MODEL_LEN")
    p.add_argument("--breakdown", action="store_true", help="also the CPU ms of each phase of a step (means)")
    p.add_argument("--bookkeeping", action="store_true", help="instead, the host's bookkeeping alone, with no "
                   "device: us per step by phase, minimum and median (this commit's internals)")
    p.add_argument("--idle-ms", type=float, default=0.0, help="with --bookkeeping: sleep this long before each "
                   "step, as the engine waits for a step's tokens")
    p.add_argument("--no-header", action="store_true")
    args = p.parse_args(argv)
    configs = [(m, n) for m in map(int, args.max_model_len.split(",")) for n in map(int, args.sequences.split(","))]
    if not args.no_header and not args.bookkeeping:
        print("| max_model_len | sequences | host CPU ms/step | wall ms/step | tokens per sequence and step |\n"
              "|---|---|---|---|---|", flush=True)
    if len(configs) > 1:  # each in a process of its own: an engine's pool outlives it in jax's caches
        for m, n in configs:
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--max-model-len", str(m), "--sequences", str(n),
                            "--no-header"], check=True)
        return
    (max_model_len, n), = configs
    engine = tiny_engine(n, args.context, args.steps * args.decode_steps, max_model_len, args.layers, args.hidden,
                         args.decode_steps, args.sliding_window)
    if args.bookkeeping:
        phases = measure_bookkeeping(engine, n, args.context, args.steps, args.idle_ms)
        print(f"  bookkeeping us at {n}, minimum / median: "
              + ", ".join(f"{label} {low:.0f} / {mid:.0f}" for label, (low, mid) in phases.items()), flush=True)
        return
    row = measure(engine, n, args.context, args.steps, args.trace and f"{args.trace}/{n}-{max_model_len}",
                  args.breakdown)
    print(f"| {max_model_len} | {n} | {row['cpu_ms']:.2f} | {row['wall_ms']:.1f} | {row['tokens_per_call']:.2f} |",
          flush=True)
    if args.breakdown:
        phases = ", ".join(f"{label.strip()} {ms:.3f}" for label, ms in row["phases"].items())
        print(f"  CPU ms by phase at {n}: {phases}", flush=True)

if __name__ == "__main__":
    main()
