"""Command line: `jaxserve generate PROMPT...` and `jaxserve serve`."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
import time

from jaxserve.entrypoints.engine_args import add_engine_args, engine_config_from_args, on_off
from jaxserve.entrypoints.tool_parsers import PARSERS as TOOL_CALL_PARSERS  # the standard library only

SERVER_MODULES = ("fastapi", "uvicorn", "zmq", "prometheus_client", "jinja2")  # jaxserve[server]
RAY_MODULES = ("ray",)  # jaxserve[ray], for --replicas


def generate(args: argparse.Namespace) -> None:
    from jaxserve.host_memory import keep_freed_memory
    keep_freed_memory()  # this process is the engine's
    from jaxserve import Engine, SamplingParams
    start = time.perf_counter()
    engine = Engine.from_pretrained(args.model, engine_config_from_args(args))
    if engine.tokenizer is not None:
        engine.tokenizer.load()  # while XLA zeroes the KV pool and places the weights
    print(f"[loaded {engine.model_name} in {time.perf_counter() - start:.1f} s]", file=sys.stderr)
    print("\n".join(f"[{line}]" for line in engine.describe().splitlines()), file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.sample_seed)
    # One-off generation compiles only the programs its steps run (saved to the compile cache
    # like every program); `serve` warms up every program before it answers.
    start = time.perf_counter()
    outputs = engine.generate(args.prompt, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompt, outputs):
        print(f"{prompt}{out.text}")
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    tokens = sum(len(o.token_ids) for o in outputs)
    cache = engine.runner.cache
    loaded = cache.loaded if cache is not None else 0
    programs = engine.stats()["num_compiles"]
    print(f"[{tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.1f} tok/s, with {programs} step programs: "
          f"{programs - loaded} compiled, {loaded} loaded from the compile cache]", file=sys.stderr)


def serve_api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $JAXSERVE_API_KEY, else vLLM's $VLLM_API_KEY (None: no key asked for)."""
    return args.api_key or os.environ.get("JAXSERVE_API_KEY") or os.environ.get("VLLM_API_KEY") or None


def serve(args: argparse.Namespace) -> None:
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"error: serving needs the server extras ({', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} missing): "
                         "pip install 'jaxserve[server]'")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout:g}")
    args.api_key = serve_api_key(args)
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        raise ValueError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    if args.engine_restarts < 0:
        raise ValueError(f"--engine-restarts must be >= 0, got {args.engine_restarts}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser: the format the model writes its "
                         f"tool calls in ({', '.join(TOOL_CALL_PARSERS)})")
    if args.replicas is not None:
        missing = [m for m in RAY_MODULES if importlib.util.find_spec(m) is None]
        if missing:
            raise SystemExit("error: --replicas runs engine replicas behind Ray Serve, which needs the ray extra "
                             f"({', '.join(missing)} is missing): pip install 'jaxserve[ray]'")
        if args.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    from jaxserve.distributed import multihost
    from jaxserve.entrypoints.engine_client import EngineClient
    from jaxserve.engine.core_process import EngineFactory
    group = multihost.group_from(args.num_processes, args.process_id, args.coordinator)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config_from_args(args)
    if group is not None:
        if args.replicas is not None:
            raise ValueError("--replicas and --num-processes do not go together: run K groups behind a router "
                             "instead (docs/scale-out.md)")
        if not config.mesh:
            raise ValueError(f"a group of {group.num_processes} processes needs --mesh over every device of every "
                             "process, e.g. model=8 for 2 hosts of 4 devices")
    if args.replicas is not None:
        from jaxserve.entrypoints import ray_serve
        ray_serve.run(args, EngineFactory(args.model, config, warmup=args.warmup))
        return
    if group is not None and not group.is_leader:  # no HTTP here: run the leader's steps
        from jaxserve.host_memory import keep_freed_memory
        keep_freed_memory()  # this process is an engine's
        multihost.follow(group, EngineFactory(args.model, config, warmup=args.warmup).build)
        return
    start = time.perf_counter()
    # The engine process starts first, and imports jax and loads the model while this process
    # imports the web stack on another core. A group's leader cannot be replaced alone.
    client = EngineClient.start_process(EngineFactory(args.model, config, warmup=args.warmup, group=group),
                                        restarts=args.engine_restarts, replaceable=group is None)
    from jaxserve.entrypoints.api_server import run
    run(args, client, start)


def build_parser() -> argparse.ArgumentParser:
    """The `jaxserve` command line: `generate` and `serve`, each with the engine's options."""
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sample-seed", type=int, default=None, help="the sampling seed of every prompt")
    add_engine_args(gen)
    gen.set_defaults(func=generate)
    srv = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server (the engine in its own process)")
    add_engine_args(srv, max_waiting=256)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None,
                     help="the bearer key clients must send (default: $JAXSERVE_API_KEY, or vLLM's $VLLM_API_KEY; "
                          "prefer those: a command line is visible to every user of the machine)")
    srv.add_argument("--trust-request-chat-template", action="store_true",
                     help="render a request's own chat_template (refused with 400 otherwise: a template may "
                          "loop for as long as it likes)")
    srv.add_argument("--tool-call-parser", choices=tuple(TOOL_CALL_PARSERS), default=None,
                     help="the format the model writes tool calls in (hermes: Qwen 2.5 and 3; llama3_json: Llama "
                          "3.1+): chat requests may then leave tool_choice \"auto\" (the default with tools), and "
                          "the calls come back as tool_calls (without it, \"auto\" with tools is refused with 400)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="accepted for vLLM's command lines, where it goes with --tool-call-parser; here "
                          "--tool-call-parser alone enables tool_choice \"auto\"")
    srv.add_argument("--warmup", type=on_off, default=True, metavar="on|off",
                     help="compile every step shape before accepting requests (default on; later starts "
                          "load them from the compile cache)")
    srv.add_argument("--chat-template", default=None, metavar="FILE",
                     help="a Jinja chat template (for a model without one of its own, e.g. an instruction-tuned "
                          "checkpoint converted without it)")
    srv.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                     help="max_tokens of a request that sets none (default: 16 for a completion, as OpenAI's; "
                          "the rest of the context for a chat completion)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="on SIGTERM or SIGINT, how long requests in flight may take to finish before they are "
                          "ended (new requests get 503 meanwhile; a second signal stops at once; default 30)")
    srv.add_argument("--engine-restarts", type=int, default=3, metavar="N",
                     help="when the engine process dies, start a new one (compiled steps from the cache) up to N "
                          "times in 10 minutes; at the next death the server exits with an error, for a "
                          "supervisor to take over (default 3; 0: no restart, the server stays up answering 503)")
    srv.add_argument("--replicas", type=int, default=None, metavar="K",
                     help="run K engine replicas behind Ray Serve on one endpoint (needs jaxserve[ray]): on the "
                          "Ray cluster RAY_ADDRESS names, else on a local one started here (docs/scale-out.md)")
    srv.add_argument("--router", choices=("prefix", "pow2", "round-robin"), default="prefix",
                     help="with --replicas: how requests pick a replica: Ray Serve's PrefixCacheAffinityRouter "
                          "(default), Ray's power of two choices, or in turn")
    srv.add_argument("--ray-actor-options", default=None, metavar="JSON",
                     help='with --replicas: Ray resources of each replica (default {"num_cpus": 1}, and on a '
                          'cluster with GPUs enough for all, the engine\'s: 1, or the --mesh size; e.g. '
                          '\'{"num_gpus": 2}\' or \'{"resources": {"TPU": 4}}\')')
    srv.add_argument("--num-processes", type=int, default=None, metavar="N",
                     help="one engine over N processes (hosts) with jax.distributed: process 0 serves HTTP and "
                          "schedules, the others run its steps on their shards (default: JAX_NUM_PROCESSES, else 1)")
    srv.add_argument("--process-id", type=int, default=None, metavar="I",
                     help="with --num-processes: this process's index, 0 for the leader (default: JAX_PROCESS_ID)")
    srv.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                     help="with --num-processes: process 0's address as every process reaches it, and a free port "
                          "(default: JAX_COORDINATOR_ADDRESS)")
    srv.set_defaults(func=serve)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")
    except RuntimeError as e:
        if type(e) is not RuntimeError:  # XLA's errors (out of memory, ...) keep their traceback
            raise
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
