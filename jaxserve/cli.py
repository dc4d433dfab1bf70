"""Command line: `jaxserve generate PROMPT...` and `jaxserve serve`."""

from __future__ import annotations

import argparse
import sys
import time


def engine_args(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that builds an engine."""
    parser.add_argument("--model", default=None, help="HF checkpoint dir or .gguf file (default: Gemma 3 270M)")
    parser.add_argument("--strategy", default="paged", choices=["none", "static", "dynamic", "continuous", "paged"])
    parser.add_argument("--max-slots", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-cache-mb", type=int, default=1024, help="KV pool budget in MiB")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "pallas", "reference"])
    parser.add_argument("--mesh", default=None, help="device mesh, e.g. data=2,model=4")


def engine_config(args: argparse.Namespace):
    from jaxserve.config import EngineConfig
    mesh = None
    if args.mesh:
        try:
            mesh = {k: int(v) for k, v in (part.split("=") for part in args.mesh.split(","))}
        except ValueError:
            raise SystemExit(f"--mesh must look like data=2,model=4, got {args.mesh!r}")
    return EngineConfig(strategy=args.strategy, max_slots=args.max_slots, page_size=args.page_size,
                        kv_cache_bytes=args.kv_cache_mb << 20, max_model_len=args.max_model_len,
                        dtype=args.dtype, attention_backend=args.attention_backend, mesh=mesh)


def generate(args: argparse.Namespace) -> None:
    from jaxserve import Engine, SamplingParams
    start = time.perf_counter()
    engine = Engine.from_pretrained(args.model, engine_config(args))
    print(f"[loaded {engine.model_name} in {time.perf_counter() - start:.1f} s]", file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    start = time.perf_counter()
    outputs = engine.generate(args.prompt, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompt, outputs):
        print(f"{prompt}{out.text}")
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    tokens = sum(len(o.token_ids) for o in outputs)
    print(f"[{tokens} tokens in {elapsed:.2f} s (compiles included): {tokens / elapsed:.1f} tok/s]", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    engine_args(gen)
    gen.set_defaults(func=generate)
    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--max-waiting", type=int, default=256)
    serve.set_defaults(func=lambda a: __import__("jaxserve.server", fromlist=["run"]).run(a))
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
