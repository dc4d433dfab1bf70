"""Command-line options -> EngineConfig, in one place for `jaxserve generate`, `jaxserve serve` and
the scripts.

Each option is one row of `_OPTIONS`: its flag, the EngineConfig field it sets and how to parse
it. An option left out on the command line is left out of the config too, so EngineConfig's own
default applies; a new EngineConfig field needs one new row here and nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Callable

from jaxserve.config import BACKENDS, DTYPES, QUANTIZATIONS, EngineConfig
from jaxserve.engine.batching.policies import STRATEGIES


def _mesh(text: str) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh must look like data=2,model=4, got {text!r}") from None


def quantization_arg(text: str) -> str | None:
    """A --quantization value: "none" is None (the benchmarks' comma lists take it too)."""
    return None if text == "none" else text


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _mib(text: str) -> int:
    return int(text) << 20


def on_off(text: str) -> bool:
    if text.lower() in ("on", "true", "1", "yes"):
        return True
    if text.lower() in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


@dataclasses.dataclass(frozen=True)
class _Option:
    flag: str
    field: str  # the EngineConfig field it sets
    help: str
    type: Callable[[str], Any] | None = int
    choices: tuple | None = None
    aliases: tuple[str, ...] = ()  # vLLM's spellings, where the meaning is the same


_OPTIONS = (
    _Option("--strategy", "strategy", "batching strategy", str, STRATEGIES),
    _Option("--max-slots", "max_slots", "sequences decoded together", aliases=("--max-num-seqs",)),
    _Option("--page-size", "page_size", "tokens per KV page", aliases=("--block-size",)),
    _Option("--num-pages", "num_pages", "KV pages in the pool (overrides --kv-cache-mb)",
            aliases=("--num-gpu-blocks-override",)),
    _Option("--kv-cache-mb", "kv_cache_bytes", "KV pool budget in MiB per memory (default: 1024 on a CPU; on an "
            "accelerator, what --gpu-memory-utilization leaves after the weights)", _mib),
    _Option("--gpu-memory-utilization", "gpu_memory_utilization",
            "accelerators: the share of device memory that weights and KV cache may take", float),
    _Option("--max-model-len", "max_model_len", "context length (default: the model's, or the longest the KV pool holds)"),
    _Option("--dtype", "dtype", "weights (auto: bfloat16 where the machine has fast bfloat16 dots, else float32)", str, DTYPES),
    _Option("--kv-cache-dtype", "kv_cache_dtype", "the KV pool", str, DTYPES),
    _Option("--quantization", "quantization", "int8 weights: int8 (read in --dtype), w8a8 (int8 activations "
            "too, where the machine has int8 dots), auto (the fastest here), or none", quantization_arg,
            QUANTIZATIONS),
    _Option("--max-num-batched-tokens", "max_num_batched_tokens", "token budget of one step"),
    _Option("--chunked-prefill", "enable_chunked_prefill", "split long prompts over steps (on/off)", on_off),
    _Option("--prefix-caching", "enable_prefix_caching", "share prompts' common leading pages (on/off)", on_off),
    _Option("--async-scheduling", "async_scheduling", "schedule step N+1 while step N runs (on/off)", on_off),
    _Option("--decode-steps", "decode_steps", "decode steps in one dispatch when every request decodes"),
    _Option("--speculative-config", "speculative", 'speculative decoding, as JSON: {"method": "ngram", '
            '"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}, or {"method": '
            '"draft_model", "model": PATH, "num_speculative_tokens": 3}', _json_object),
    _Option("--attention-backend", "attention_backend", "attention implementation", str, BACKENDS),
    _Option("--batch-size", "batch_size", "dynamic batching: requests per batch"),
    _Option("--max-batch-delay-ms", "max_batch_delay_ms", "dynamic batching: wait for a batch to fill", float),
    _Option("--max-waiting", "max_waiting", "bound of the waiting queue (the server answers 429 past it)"),
    _Option("--seed", "seed", "seed of the per-request seeds drawn when a request has none"),
    _Option("--mesh", "mesh", "device mesh, e.g. data=2,model=4", _mesh),
)


def add_engine_args(parser: argparse.ArgumentParser, **defaults) -> None:
    """Adds `--model` and one option per EngineConfig field that a user may set; `defaults`
    (by field name) replace EngineConfig's defaults for this command."""
    parser.add_argument("--model", default=None, help="HF checkpoint dir, .gguf file or Orbax checkpoint "
                                                      "(default: Gemma 3 270M)")
    config = EngineConfig()
    for o in _OPTIONS:
        default = defaults.get(o.field, getattr(config, o.field))
        shown = f"{default >> 20} MiB" if o.field == "kv_cache_bytes" and default else default
        metavar = "on|off" if o.type is on_off else None if o.choices else o.flag[2:].upper().replace("-", "_")
        parser.add_argument(o.flag, *o.aliases, dest=o.field, type=o.type, choices=o.choices,
                            default=defaults.get(o.field), metavar=metavar,
                            help=o.help if default is None else f"{o.help} (default: {shown})")


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The EngineConfig of parsed arguments: given options, then `overrides`, over the defaults.
    Raises ValueError for values EngineConfig refuses."""
    given = {o.field: getattr(args, o.field) for o in _OPTIONS
             if getattr(args, o.field, None) is not None}
    return EngineConfig(**{**given, **overrides})
