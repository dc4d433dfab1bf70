"""What an engine's resources come to on this machine: the model's weights on the device (in
the dtype, or per program the dtypes, measured fastest here), a KV pool in the memory left, the
longest context that pool holds, and the runner over them; with why each has its value, for
start-up to print (`describe`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
from fractions import Fraction

import jax
import jax.numpy as jnp

from jaxserve.config import QUANTIZATIONS, EngineConfig
from jaxserve.cpu_kernels.decode_attention import CpuDecodeAttention
from jaxserve.cpu_kernels.decode_attention import load as load_decode_kernel
from jaxserve.cpu_kernels.int8_dot import load as load_int8_kernel
from jaxserve.distributed.sharding import kv_heads_per_memory, make_mesh
from jaxserve.engine.batching.kv_cache_manager import pages_per_sequence
from jaxserve.engine.batching.sampling_params import MAX_LOGPROBS
from jaxserve.model.config import ModelConfig
from jaxserve.model.kv_groups import kv_groups
from jaxserve.model.loader import cache_root
from jaxserve.model.quantization import GROUPS, OUTLIERS, Int8Dot, block_rows
from jaxserve.model.transformer import Transformer
from jaxserve.worker.calibration import rounded_layers
from jaxserve.worker.dtype_plan import DtypePlan, plan_for
from jaxserve.worker.kv_pool import page_bytes
from jaxserve.worker.machine import (INT8_FLAGS, auto_kv_cache_bytes, auto_weights_dtype, bf16_dot_instructions,
                                     int8_dot_instructions)
from jaxserve.worker.quantization_plan import auto_quantization
from jaxserve.worker.quantization_plan import integer_rows as planned_integer_rows
from jaxserve.worker.runner import Runner, RunnerConfig
from jaxserve.worker.step_batch import StepBuckets

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Reasons:
    """Why start-up resolved what it did, for `describe`."""

    kv_budget: str
    max_model_len: str
    weights: str
    quantization: str


INHERITED = Reasons(*["the engine it was made from"] * 4)  # an engine over another's runner


def build_runner(config: EngineConfig, model_config: ModelConfig, weights, backend: str,
                 draft: ModelConfig | None = None, tokenizer=None) -> tuple[Runner, Reasons]:
    """The model on the device, then a KV pool in the memory it leaves, and their runner; with
    why the pool has its size, max_model_len its value, and the weights their dtype. `draft`: a
    draft model whose pool will have as many pages (`jaxserve.engine.draft_model`): the budget
    holds both. `tokenizer`: the model's, for int8's calibration text."""
    mesh = make_mesh(config.mesh) if config.mesh else None
    quant, quant_reason = resolve_quantization(config, model_config, mesh)
    if quant is not None and quant.mode == "int8":  # its layers one scale per output channel, rounded by GPTQ
        weights = rounded_layers(model_config, weights, tokenizer, cache_root())
    model = Transformer(model_config, weights, jnp.dtype(config.weights_dtype), quant=quant)  # on the device now
    kv_bytes, reason = ((config.kv_cache_bytes, "asked for") if config.kv_cache_bytes
                        else auto_kv_cache_bytes(config.gpu_memory_utilization))
    def heads_in_memory(cfg: ModelConfig) -> int:  # a model's kv heads in the fullest memory
        return kv_heads_per_memory(mesh, cfg) if mesh else cfg.num_kv_heads
    heads = heads_in_memory(model_config)
    share = Fraction(heads, model_config.num_kv_heads)  # of the pool's bytes, in the fullest memory
    if share != 1:
        reason += (f", held {share} times over in the host memory its devices share" if share > 1
                   else f", each device holding {share} of the pool")
    per_page = page_bytes(model_config, config.page_size, config.kv_dtype, heads)
    if draft is not None:
        per_page += page_bytes(draft, config.page_size, config.kv_dtype, heads_in_memory(draft))
        reason += ", shared with the draft model's pool"
    num_pages = config.num_pages or kv_bytes // per_page
    if num_pages < 2:
        raise ValueError(f"kv_cache_bytes={kv_bytes} holds no KV page")
    max_model_len, why = _resolve_max_model_len(config, model_config, num_pages)
    log.info("max_model_len %d (%s)", max_model_len, why)
    budget = config.step_token_budget(max_model_len)
    model, other, plan, weights_reason = _dtype_per_program(config, model_config, model, weights, budget, mesh)
    decode_kernel = None  # XLA cannot partition the kernel's call: under a mesh, jnp's decode rows
    if backend == "reference" and jax.default_backend() == "cpu" and mesh is None and \
            CpuDecodeAttention.fits(model_config.head_dim):
        decode_kernel = load_decode_kernel(cache_root())[0]
    runner = Runner(model, RunnerConfig(
        num_pages=num_pages, page_size=config.page_size, max_slots=config.max_slots,
        max_model_len=max_model_len, attention_backend=backend, decode_kernel=decode_kernel,
        max_num_batched_tokens=budget, num_logprobs=MAX_LOGPROBS, decode_steps=config.decode_steps,
        kv_dtype=config.kv_dtype, cache_dir=os.path.join(cache_root(), "compiled"),
        speculative_tokens=config.speculative.num_speculative_tokens if config.speculative else 0,
        program_dtypes=plan.programs() if plan else (), min_rows=plan.min_rows if plan else None),
        mesh=mesh, other=other)
    return runner, Reasons(reason, why, weights_reason, quant_reason)

def _dtype_per_program(config: EngineConfig, model_config: ModelConfig, model: Transformer, weights, budget: int,
                       mesh) -> tuple[Transformer, Transformer | None, DtypePlan | None, str]:
    """(the runner's model, its copy in another dtype or None, the plan or None, why): with
    dtype="auto" on one CPU without bfloat16 dot instructions, each program's dtype as measured
    there (`jaxserve.worker.dtype_plan`); else every program in the loaded dtype."""
    if config.dtype != "auto":
        return model, None, None, "asked for"
    reason = auto_weights_dtype()[1]
    one_copy = model.quant is not None  # int8 weights, read in the loaded dtype
    if jax.default_backend() != "cpu" or mesh is not None or bf16_dot_instructions() or one_copy:
        return model, None, None, reason
    sizes = StepBuckets(max_tokens=budget, max_seqs=config.max_slots)
    plan = plan_for(model_config, sizes.token_sizes, sizes.row_sizes, config.weights_dtype,
                    os.path.join(cache_root(), "dtype_plans.json"))
    reason = f"{reason}; {plan.describe()}"
    log.info("weights %s: %s", "/".join(sorted(plan.dtypes())), reason)
    other = next((Transformer(model_config, weights, jnp.dtype(dtype))
                  for dtype in plan.dtypes() - {config.weights_dtype}), None)
    if config.weights_dtype not in plan.dtypes():  # every program in the other dtype
        return other, None, plan, reason
    return model, other, plan, reason


def resolve_quantization(config: EngineConfig, model_config: ModelConfig, mesh) -> tuple[Int8Dot | None, str]:
    """How the model's dots read int8 weights (None: float weights), and why. w8a8 asked for on a
    CPU without int8 dot instructions is a ValueError; "auto" never fails. int8's integer dots are
    chosen by measuring them here (`quantization_plan.integer_rows`)."""
    mode, reason = config.quantization, "asked for" if config.quantization else "the default"
    cpu = jax.default_backend() == "cpu"
    plans = os.path.join(cache_root(), "quantization_plans.json")
    integer_rows, integer_reason, kernel, no_kernel = (0, 0), "", None, ""  # rows: the layers', the output layer's
    if mode in ("int8", "auto"):
        if cpu and mesh is None:  # XLA cannot partition the kernel's call: under a mesh, XLA's dots
            kernel, why = load_int8_kernel(cache_root())
            no_kernel = "" if kernel else f" ({why})"
        integer_rows, integer_reason = planned_integer_rows(model_config, config.weights_dtype, plans, kernel=kernel)
        integer_reason += no_kernel
    if mode == "auto":
        smallest = 2 if cpu and config.weights_dtype == "bfloat16" else 1  # the runner's smallest row bucket
        mode, reason = auto_quantization(model_config, config.weights_dtype, smallest, plans,
                                         integer_rows=integer_rows, kernel=kernel)
    if mode is None:
        return None, reason
    if mode == "w8a8" and cpu and not int8_dot_instructions():
        raise ValueError(f"quantization='w8a8' needs int8 dot instructions, which this CPU lacks "
                         f"({', '.join(sorted(INT8_FLAGS))}); choose one of {QUANTIZATIONS}, e.g. 'int8'")
    # XLA:CPU converts a whole int8 operand before a dot: the output layer is read in blocks
    rows = block_rows(model_config.vocab_size, model_config.hidden_size) if cpu and mesh is None else 0
    kernel = kernel if any(integer_rows) else None
    quant = Int8Dot(mode, config.weights_dtype, rows, GROUPS[mode], OUTLIERS[mode], integer_rows[0],  # w8a8: 0
                    kernel, integer_rows[1], layers_transposed=kernel is not None and integer_rows[0] > 0)
    return quant, f"{reason}; {integer_reason}" if integer_reason else reason


def _resolve_max_model_len(config: EngineConfig, model_config: ModelConfig, num_pages: int) -> tuple[int, str]:
    """(max_model_len, why): as asked, if the pool holds one sequence of it (else ValueError);
    by default the model's context if the pool holds one, else the longest sequence it holds."""
    windows, context, usable = kv_groups(model_config).windows, model_config.max_position_embeddings, num_pages - 1

    def pages(length: int) -> int:
        return pages_per_sequence(windows, config.page_size, length, config.step_token_budget(length))

    def longest() -> int:  # pages() grows with the length
        lo, hi = 0, context
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if pages(mid) <= usable else (lo, mid - 1)
        return lo
    if config.max_model_len is not None:
        if pages(config.max_model_len) > usable:
            raise ValueError(f"max_model_len {config.max_model_len} does not fit the KV pool: one sequence of "
                             f"{config.max_model_len} tokens needs {pages(config.max_model_len)} pages, the pool "
                             f"has {usable}, which hold at most {longest()} tokens")
        return config.max_model_len, "asked for"
    if pages(context) <= usable:
        return context, "the model's context"
    length = longest()
    if length < 2:
        raise ValueError(f"the KV pool ({usable} pages) cannot hold a sequence of 2 tokens")
    return length, (f"the longest sequence the KV pool holds: the model's context of {context} tokens "
                    f"needs {pages(context)} pages, the pool has {usable}")


def describe_groups(groups) -> str:
    """One line, e.g. `KV-cache groups: 1 full attention, 5 sliding (window 512); 3 layers per page`."""
    kinds = collections.Counter(groups.windows)
    parts = [f"{n} full attention" if w is None else f"{n} sliding (window {w})" for w, n in kinds.items()]
    return f"KV-cache groups: {', '.join(parts)}; {groups.layers_per_page} layers per page"
