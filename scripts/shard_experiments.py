"""Sharding experiments on simulated CPU devices: for each (data x model) mesh, the prefill and
decode step times, bytes per device of parameters and KV pool, and the collectives XLA put in the
compiled steps (in total and per decoder layer).

    python scripts/shard_experiments.py                      # tiny Llama-shaped model, 8 devices
    python scripts/shard_experiments.py --gemma3 --meshes 1x1,1x4   # Gemma 3 270M shapes (random)
    python scripts/shard_experiments.py --json out.json

All simulated devices share this machine's cores, so step times show the partitioning overhead
(more, smaller ops plus collectives), not a speed-up; bytes and collective counts carry over to real
devices. Per-layer counts come from compiling a 1-layer copy of the model too:
per layer = (count(L layers) - count(1 layer)) / (L - 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time

DEVICES = 8
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxserve import sharding  # noqa: E402
from jaxserve.model.config import ModelConfig  # noqa: E402
from jaxserve.model.transformer import Transformer  # noqa: E402
from jaxserve.model.weights import expected_shapes  # noqa: E402
from jaxserve.worker.runner import Runner, RunnerConfig  # noqa: E402
from jaxserve.worker.sampling import SamplingBatch  # noqa: E402
from jaxserve.model.kv_groups import kv_groups  # noqa: E402
from jaxserve.worker.step_batch import ScheduledSeq, build_step  # noqa: E402

MESHES = "1x1,1x2,1x4,1x8,2x4,4x2,8x1"
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def tiny_llama(layers: int = 4) -> ModelConfig:
    """Llama-shaped, small enough for 2 CPU cores, 8 kv heads so an 8-way model axis splits them."""
    return ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=layers, num_heads=16,
                       num_kv_heads=8, head_dim=64, max_position_embeddings=1024)


def gemma3_270m(layers: int = 18) -> ModelConfig:
    """Gemma 3 270M shapes (1 kv head: the KV pool is replicated over the model axis)."""
    return ModelConfig(family="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=layers,
                       num_heads=4, num_kv_heads=1, head_dim=256, qk_norm=True, sandwich_norms=True,
                       activation="gelu_tanh", tie_embeddings=True, embed_scale=640 ** 0.5, query_scale=256 ** -0.5,
                       max_position_embeddings=32768)


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape, np.float32) * (0.02 if len(shape) > 1 else 1.0) + (len(shape) == 1)
            for name, shape in expected_shapes(cfg).items()}


def count_collectives(hlo: str) -> dict[str, int]:
    return {op: len(re.findall(rf"= [^=]*? {op}(?:-start)?\(", hlo)) for op in COLLECTIVES}


class Workload:
    """One prefill step (whole prompts) and one full decode step, each sequence on its own pages."""

    def __init__(self, runner: Runner, prefill_batch: int, prompt_len: int, context: int, seed: int = 0):
        cfg, rc = runner.model_config, runner.config
        rng = np.random.default_rng(seed)
        slots, pages, groups = rc.max_slots, runner.pages_per_seq, runner.kv_groups.num_groups
        self.tables = (1 + np.arange(slots * groups * pages, dtype=np.int32)).reshape(slots, groups, pages)
        zeros = lambda n, dt: np.zeros(n, dt)  # noqa: E731
        self.sampling = SamplingBatch(zeros(slots, np.float32), zeros(slots, np.int32), np.ones(slots, np.float32),
                                      zeros(slots, np.float32), zeros(slots, np.uint32))
        prompts = [rng.integers(3, cfg.vocab_size, prompt_len).tolist() for _ in range(prefill_batch)]
        self.prefill_seqs = [ScheduledSeq(i, 0, p) for i, p in enumerate(prompts)]
        self.decode_seqs = [ScheduledSeq(i, context - 1, [int(t)])
                            for i, t in enumerate(rng.integers(3, cfg.vocab_size, slots))]

        self.shapes: dict[str, tuple[int, int]] = {}  # compiled (tokens, sequences) of each step

    def run(self, runner: Runner, name: str, seqs):
        batch = build_step(seqs, self.tables, self.sampling, runner.config.page_size, runner.buckets,
                           runner.replicas)
        self.shapes[name] = batch.shape
        return runner.step(batch).tokens[batch.rows]

    def prefill(self, runner: Runner):
        return self.run(runner, "prefill", self.prefill_seqs)

    def decode(self, runner: Runner):
        return self.run(runner, "decode", self.decode_seqs)


def timed(fn, reps: int) -> float:
    fn()  # compile and warm up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build(cfg: ModelConfig, weights, mesh, args) -> Runner:
    pages = args.slots * kv_groups(cfg).num_groups * -(-args.max_len // args.page_size)  # every slot's tables
    rc = RunnerConfig(num_pages=1 + pages, page_size=args.page_size,
                      max_slots=args.slots, max_model_len=args.max_len,
                      max_num_batched_tokens=max(args.slots, args.prefill_batch * args.prompt_len))
    return Runner(Transformer(cfg, weights), rc, mesh=mesh)


def hlo_counts(runner: Runner, work: Workload) -> dict[str, dict[str, int]]:
    """Collectives of the compiled prefill and decode steps (the only two compiled)."""
    return {name: count_collectives(runner._compiled[(shape, False)].as_text()) for name, shape in work.shapes.items()}


def run_mesh(shape: str, cfg: ModelConfig, weights, one_layer: tuple, args) -> dict:
    data, model = map(int, shape.split("x"))
    mesh = sharding.make_mesh({"data": data, "model": model})
    runner = build(cfg, weights, mesh, args)
    work = Workload(runner, args.prefill_batch, args.prompt_len, args.context)
    prefill_s = timed(lambda: work.prefill(runner), args.reps)
    decode_s = timed(lambda: work.decode(runner), args.reps)
    assert runner.num_compiles == 2, runner._compiled.keys()
    total = hlo_counts(runner, work)
    small = build(*one_layer, mesh, args)  # same mesh, 1 layer: only compiled, for per-layer counts
    small_work = Workload(small, args.prefill_batch, args.prompt_len, args.context)
    small_work.prefill(small), small_work.decode(small)
    base = hlo_counts(small, small_work)
    per_layer = {step: {op: (total[step][op] - base[step][op]) / (cfg.num_layers - 1) for op in COLLECTIVES}
                 for step in total}
    first = work.decode(runner)
    return {"mesh": shape, "data": data, "model": model,
            "prefill_ms": prefill_s * 1e3, "decode_ms": decode_s * 1e3,
            "param_bytes_per_device": sharding.bytes_per_device(runner.state),
            "kv_bytes_per_device": sharding.bytes_per_device(runner.kv_pool),
            "collectives": total, "collectives_per_layer": per_layer, "decode_tokens": first.tolist()}


def short(counts: dict[str, float]) -> str:
    names = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "collective-permute": "CP",
             "all-to-all": "A2A"}
    parts = [f"{names[op]} {counts[op]:g}" for op in COLLECTIVES if counts[op]]
    return ", ".join(parts) or "none"


def table(rows: list[dict]) -> str:
    lines = ["| mesh (data x model) | prefill ms | decode ms | params MiB/device | KV MiB/device "
             "| decode collectives: per layer / whole step | prefill collectives: per layer / whole step |",
             "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['mesh']} | {r['prefill_ms']:.1f} | {r['decode_ms']:.1f} | {r['param_bytes_per_device'] / 2**20:.1f} "
            f"| {r['kv_bytes_per_device'] / 2**20:.1f} "
            f"| {short(r['collectives_per_layer']['decode'])} / {short(r['collectives']['decode'])} "
            f"| {short(r['collectives_per_layer']['prefill'])} / {short(r['collectives']['prefill'])} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--meshes", default=MESHES, help=f"comma-separated data x model shapes (default {MESHES})")
    parser.add_argument("--gemma3", action="store_true", help="Gemma 3 270M shapes with random weights")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: 4 tiny, 18 Gemma 3)")
    parser.add_argument("--slots", type=int, default=32, help="decode batch (max_slots)")
    parser.add_argument("--prefill-batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--context", type=int, default=128, help="tokens per sequence in the decode step")
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    make = gemma3_270m if args.gemma3 else tiny_llama
    cfg = make(args.layers) if args.layers else make()
    small_cfg = cfg.replace(num_layers=1, layer_windows=None, layer_rope_thetas=None)
    weights = random_weights(cfg)
    small_weights = {k: v for k, v in weights.items() if not k.startswith("layers.") or k.startswith("layers.0.")}
    print(f"model: {'Gemma 3 270M shapes' if args.gemma3 else 'tiny Llama'} "
          f"(L {cfg.num_layers}, D {cfg.hidden_size}, H {cfg.num_heads}, N {cfg.num_kv_heads}, K {cfg.head_dim}, "
          f"F {cfg.intermediate_size}, V {cfg.vocab_size}); {jax.device_count()} {jax.default_backend()} devices; "
          f"decode {args.slots} slots at {args.context} tokens, prefill {args.prefill_batch} x {args.prompt_len}",
          flush=True)
    rows = []
    for shape in args.meshes.split(","):
        start = time.perf_counter()
        rows.append(run_mesh(shape, cfg, weights, (small_cfg, small_weights), args))
        same = rows[-1]["decode_tokens"] == rows[0]["decode_tokens"]
        print(f"  {shape}: {time.perf_counter() - start:.1f}s, greedy decode tokens == {rows[0]['mesh']}: {same}",
              flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "model_config": dataclasses.asdict(cfg), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
