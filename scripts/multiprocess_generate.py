"""One engine across several processes: each process drives the same scheduler over the same
requests, so the SPMD steps line up, and every process reads the same (replicated) sampled tokens.

    # two terminals (or `&`), same port:
    python scripts/multiprocess_generate.py --process-id 0 --num-processes 2 --port 23456
    python scripts/multiprocess_generate.py --process-id 1 --num-processes 2 --port 23456
    python scripts/multiprocess_generate.py --single           # the one-device reference

Each process simulates `--devices-per-process` CPU devices and talks to the others through gloo;
together they form the `--mesh` (default data=2,model=4: data across processes, model within one).
The model is a tiny random Llama-shaped one, identical in every process (fixed seed). The last line
printed is JSON: {"process": i, "tokens": [[...], ...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_model():
    """(config, weights) of a small random Llama-shaped model: 8 kv heads split over 4 devices."""
    from jaxserve.model.config import ModelConfig
    from jaxserve.model.weights import expected_shapes
    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=16,
                      num_kv_heads=8, head_dim=8, max_position_embeddings=128)
    rng = np.random.RandomState(0)
    return cfg, {k: (rng.randn(*s) * 0.3).astype(np.float32) for k, s in sorted(expected_shapes(cfg).items())}


def generate(mesh: dict | None, num_prompts: int = 6, max_tokens: int = 10) -> list[list[int]]:
    """Greedy tokens of a fixed set of prompts (the same in every process)."""
    from jaxserve import Engine, EngineConfig, SamplingParams
    cfg, weights = tiny_model()
    engine = Engine(cfg, weights, None, EngineConfig(max_slots=8, page_size=8, num_pages=64, max_model_len=64, dtype="float32",
                                                     mesh=mesh))
    rng = np.random.RandomState(1)
    prompts = [rng.randint(3, 250, size=n).tolist() for n in (3, 9, 17, 5, 12, 1, 30, 8)[:num_prompts]]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def parse_mesh(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (part.split("=") for part in text.split(","))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--port", type=int, default=23456, help="coordinator port on 127.0.0.1")
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("--mesh", default="data=2,model=4")
    parser.add_argument("--single", action="store_true", help="one process, one device: the reference")
    args = parser.parse_args()
    if args.single:
        print(json.dumps({"process": 0, "tokens": generate(None)}))
        return
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices_per_process}").strip()
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id)
    print(f"process {jax.process_index()}/{jax.process_count()}: {jax.local_device_count()} local, "
          f"{jax.device_count()} global devices", file=sys.stderr, flush=True)
    tokens = generate(parse_mesh(args.mesh))
    print(json.dumps({"process": jax.process_index(), "tokens": tokens}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
