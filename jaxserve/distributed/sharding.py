"""Meshes and PartitionSpecs: how parameters, the KV pool and step inputs are laid out on devices.

This is the only module that names mesh axes (practice 7). Everything else speaks in logical axes,
and `RULES` maps each logical axis to a mesh axis (or to None: replicated):

    mesh  (data, model)            EngineConfig.mesh, e.g. {"data": 2, "model": 4}
    params                          Megatron-style tensor parallelism on `model`:
      embed    [V, D]   vocab on model    (vocab-parallel embedding; tied lm head reuses it)
      lm_head  [D, V]   vocab on model    (column-parallel logits; argmax reduces per shard)
      qkv      [D, N(G+2)K]  columns on model       (column-parallel in, grouped per kv head)
      out      [H K, D]      rows on model          (row-parallel out: one all-reduce)
      gate_up  [D, F 2]      columns on model       (column-parallel in, interleaved per unit)
      down     [F, D]        rows on model          (row-parallel out: one all-reduce)
      norms    [D] / [K]     replicated
    layers   stacked params [L, ...] and pool: the layer axis is never split
    KV pool  [N, P, M, S, K] (P layers per page): kv heads on model, pages replicated over data
    step inputs  flat tokens and per-sequence metadata: one equal slice per data replica, on data
    attention    per shard (shard_map): each replica's sequences, kv heads (with their query heads) on model
    step outputs sampled tokens (and logprobs) replicated, so every host can read them

Steps are compiled with `jax.jit` and explicit in/out shardings; XLA's GSPMD partitioner inserts
the collectives. Three choices are worth knowing:

* Fused q|k|v and gate|up. The model fuses q/k/v per kv-head group (`[D, N (G + 2) K]`: each kv
  head's query heads, then its k and v) and interleaves gate/up per MLP unit (`[D, F 2]`), so a
  contiguous column split hands each device whole groups and units: no columns move between
  devices, and each layer costs Megatron's two all-reduces. When the kv heads (or MLP units) do not
  divide the model axis, the fused matrix is replicated instead (see below).
* KV pool and `data`. Slots are sharded on `data`, but the pool's pages are replicated over
  `data` (sharded only by kv heads on `model`). The block manager hands out pages from one
  global id space and knows nothing of replicas, so any page may belong to any slot; replicating
  the pool keeps every page readable where its slot runs, and the cost is a small all-gather of
  each step's new K/V over `data` (XLA makes the replicas' writes agree). A pool whose pages are
  split across `data` (capacity growing with replicas) needs a replica-aware block manager that
  hands a slot only pages of its own replica: a change in `batching/`, not here.
* kv heads that do not divide the model axis (e.g. Gemma 3 270M: one kv head). Every dimension
  whose unit count (heads, kv heads, MLP units, vocab, batch rows) does not divide its mesh axis
  is replicated instead of split; GSPMD keeps results exact either way. Sequences are the
  exception: `max_slots` must divide by `data` (ValueError), since each replica owns its slots.

Attention runs per shard through `shard_map` (`per_shard_attention`), since GSPMD cannot split a
Pallas kernel (it would gather the whole pool onto every device) nor the reference's loops over
sequences: each device attends for its replica's sequences with its own kv heads and their query
heads. When the kv heads do not divide `model`, the pool and the query heads are whole on every
`model` device and attention is repeated there.
Legend: B batch, V vocab, D hidden, H query heads, N kv heads, K head dim, F MLP width,
M pool pages, S page size.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Mapping

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.model.config import ModelConfig
from jaxserve.model.paged_attention import StepMetadata

log = logging.getLogger(__name__)

MESH_AXES = ("data", "model")

# Logical axis -> mesh axis (None: replicated). The one table of sharding rules.
RULES: dict[str, str | None] = {
    "batch": "data",  # decode slots / prefill rows: each data-parallel replica runs its own
    "vocab": "model",  # embedding rows, lm-head columns, logits
    "embed": None,  # hidden size D: replicated, so norms and residual adds need no communication
    "heads": "model",  # query heads: q columns (H K), o_proj rows
    "kv_heads": "model",  # kv heads: k/v columns (N K), the KV pool's first axis
    "qkv": "model",  # fused q|k|v columns (N groups of (G + 2) K)
    "mlp": "model",  # MLP units F: gate/up columns, down rows
    "gate_up": "model",  # fused gate|up columns (F units of 2)
    "head_dim": None,
    "pages": None,  # KV pool pages: replicated over data (see the module docstring)
    "page_offset": None,
    "length": None,  # tokens of a prompt, block-table width
    "layers": None,  # the stacked layers of params and pool: each device holds every layer
}

# Logical axes of the model's parameters, by the last two names of their nnx path.
MODEL_PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "embed_scales": ("vocab", "embed"),  # int8 weights' scales lie like their weights (`model.quantization`)
    "lm_head": ("embed", "vocab"),
    "lm_head_scales": ("embed", "vocab"),
    "embed_outliers": ("vocab", None),  # int8's output layer: the weights of its input channels kept in float
    "lm_head_outliers": (None, "vocab"),
    "embed_outlier_channels": (None,),
    "lm_head_outlier_channels": (None,),
    "attn.qkv": ("embed", "qkv"),
    "attn.qkv_scale": ("embed", "qkv"),
    "attn.out_scale": ("heads", "embed"),
    "mlp.gate_up_scale": ("embed", "gate_up"),
    "mlp.down_scale": ("mlp", "embed"),
    "attn.qkv_bias": ("qkv",),
    "attn.out": ("heads", "embed"),
    "mlp.gate_up": ("embed", "gate_up"),
    "mlp.down": ("mlp", "embed"),
    "q_norm.weight": ("head_dim",),
    "k_norm.weight": ("head_dim",),
}
NORM_AXES = ("embed",)  # every other `*norm.weight`

# Logical axes of the canonical (checkpoint) weights, by name without the `layers.{i}.` prefix.
CANONICAL_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "q_proj": ("embed", "heads"), "k_proj": ("embed", "kv_heads"), "v_proj": ("embed", "kv_heads"),
    "q_bias": ("heads",), "k_bias": ("kv_heads",), "v_bias": ("kv_heads",),
    "o_proj": ("heads", "embed"),
    "gate_proj": ("embed", "mlp"), "up_proj": ("embed", "mlp"), "down_proj": ("mlp", "embed"),
    "q_norm": ("head_dim",), "k_norm": ("head_dim",),
}

KV_POOL_AXES = ("kv_heads", "layers", "pages", "page_offset", "head_dim")  # [N, P, M, S, K]


# ---- the mesh ----

def make_mesh(shape: Mapping[str, int] | None, devices=None) -> Mesh:
    """A (data, model) mesh from `EngineConfig.mesh`, e.g. {"data": 2, "model": 4}.

    Missing axes have size 1. Uses `devices` (all of them) or else the first data x model devices;
    raises ValueError on unknown axis names or a device count that does not match.
    """
    shape = dict(shape or {})
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"unknown mesh axis name(s) {unknown}; the mesh axes are {MESH_AXES}")
    sizes = tuple(shape.get(axis, 1) for axis in MESH_AXES)
    if any(not isinstance(s, int) or s <= 0 for s in sizes):
        raise ValueError(f"mesh axis sizes must be integers > 0, got {shape}")
    needed = math.prod(sizes)
    if devices is None:
        available = jax.devices()
        if needed > len(available) or (jax.process_count() > 1 and needed != len(available)):
            raise ValueError(f"mesh {shape} needs {needed} devices (the product of its axis sizes) "
                             f"but {len(available)} are available across {jax.process_count()} process(es)")
        devices = available[:needed]
    elif needed != len(devices):
        raise ValueError(f"mesh {shape} needs {needed} devices (the product of its axis sizes), "
                         f"got {len(devices)}")
    try:
        grid = mesh_utils.create_device_mesh(sizes, devices=list(devices))  # topology-aware on TPU
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.asarray(devices).reshape(sizes)
    return Mesh(grid, MESH_AXES)


def axis_size(mesh: Mesh, logical: str) -> int:
    """Devices a logical axis is split over (1 when the rules replicate it)."""
    axis = RULES[logical]
    return 1 if axis is None else mesh.shape[axis]


def spec(mesh: Mesh, axes: tuple[str | None, ...], units: Mapping[str, int] | None = None,
         shape: tuple[int, ...] | None = None) -> PartitionSpec:
    """PartitionSpec for an array whose dims have these logical axes.

    A dim is split only if its unit count (`units[axis]`, e.g. heads for the H K columns; else the
    dim's size from `shape`) divides by the mesh axis size; otherwise it is replicated.
    """
    out = []
    for i, logical in enumerate(axes):
        axis = None if logical is None else RULES[logical]
        if axis is not None:
            count = (units or {}).get(logical, shape[i] if shape is not None else None)
            if count is None or count % mesh.shape[axis] or (shape is not None and shape[i] % mesh.shape[axis]):
                axis = None
        out.append(axis)
    return PartitionSpec(*out)


def units_of(cfg: ModelConfig) -> dict[str, int]:
    """How many whole units each logical axis holds: a split never cuts through a head."""
    h, n = cfg.num_heads, cfg.num_kv_heads
    # Fused qkv columns come in kv-head groups and gate_up columns in MLP units (see the model).
    return {"vocab": cfg.vocab_size, "heads": h, "kv_heads": n, "qkv": n,
            "mlp": cfg.intermediate_size, "gate_up": cfg.intermediate_size, "embed": cfg.hidden_size,
            "head_dim": cfg.head_dim}


# ---- parameters ----

def param_axes(path: tuple[str, ...]) -> tuple[str | None, ...]:
    """Logical axes of a model parameter from its nnx path, e.g. ("layers", "attn", "qkv"): the
    layers' parameters are stacked, so they lead with the "layers" axis."""
    names = [p for p in path if p != "value"]
    lead = ("layers",) if names[0] == "layers" else ()
    for key in (".".join(names[-2:]), names[-1]):
        if key in MODEL_PARAM_AXES:
            return lead + MODEL_PARAM_AXES[key]
    if names[-1] == "weight" and names[-2].endswith("norm"):
        return lead + NORM_AXES
    raise ValueError(f"no sharding rule for parameter {'.'.join(names)!r}; add it to MODEL_PARAM_AXES")


def param_shardings(state, mesh: Mesh, cfg: ModelConfig):
    """A pytree like `state` (from `nnx.split`) of NamedShardings, one per parameter."""
    units = units_of(cfg)

    def one(path, x):
        names = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        return NamedSharding(mesh, spec(mesh, param_axes(names), units, x.shape))
    return jax.tree_util.tree_map_with_path(one, state)


def canonical_sharding_for(mesh: Mesh, cfg: ModelConfig) -> Callable[[str, tuple[int, ...]], NamedSharding]:
    """`sharding_for(name, shape)` for `restore_checkpoint`: each device reads its own shard of
    every canonical weight (see `jaxserve.model.weights`)."""
    units = units_of(cfg)

    def sharding_for(name: str, shape: tuple[int, ...]) -> NamedSharding:
        base = name.split(".")[-1]
        axes = CANONICAL_AXES.get(base, NORM_AXES if base.endswith("norm") else None)
        if axes is None:
            raise ValueError(f"no sharding rule for weight {name!r}; add it to CANONICAL_AXES")
        return NamedSharding(mesh, spec(mesh, axes, units, shape))
    return sharding_for


# ---- KV pool and step inputs ----

def kv_pool_sharding(mesh: Mesh, cfg: ModelConfig) -> NamedSharding:
    """Sharding of each layer's K and V `[N, M, S, K]`: kv heads on `model` when they divide it,
    else replicated (logged: every model-parallel device then holds the whole pool)."""
    s = spec(mesh, KV_POOL_AXES, units_of(cfg))
    if s[0] is None and axis_size(mesh, "kv_heads") > 1:
        log.warning("%d kv heads do not divide the %d-way model axis: the KV pool is replicated over it",
                    cfg.num_kv_heads, axis_size(mesh, "kv_heads"))
    return NamedSharding(mesh, s)


def kv_heads_per_memory(mesh: Mesh, cfg: ModelConfig) -> int:
    """Kv heads of every page that the fullest memory holds, so that a KV byte budget holds per
    memory: an accelerator holds its own shard, while a CPU process's devices share one memory,
    where their shards add up (a pool replicated over 8 simulated devices is 8 pools' bytes)."""
    pool = NamedSharding(mesh, spec(mesh, KV_POOL_AXES, units_of(cfg)))  # kv_pool_sharding's, unlogged
    heads = pool.shard_shape((cfg.num_kv_heads,) + (1,) * (len(KV_POOL_AXES) - 1))[0]
    local = mesh.local_devices
    return heads * (len(local) if local[0].platform == "cpu" else 1)


def batch_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Rows of a step input `[B, ...]` on `data` when B divides by it, else replicated."""
    return NamedSharding(mesh, spec(mesh, ("batch",) + (None,) * (len(shape) - 1), shape=shape))


def check_replicas(mesh: Mesh, max_slots: int) -> int:
    """Data-parallel replicas of a step; each one owns max_slots / replicas slots."""
    replicas = axis_size(mesh, "batch")
    if max_slots % replicas:
        raise ValueError(f"max_slots ({max_slots}) must be a multiple of the data-parallel axis size ({replicas})")
    return replicas


def per_shard_attention(attend, mesh: Mesh, cfg: ModelConfig):
    """`attend` run per shard: tokens and sequence metadata split by replica on `data`, the pool's
    kv heads and their query heads on `model` (or both whole when the kv heads do not divide it)."""
    pool = kv_pool_sharding(mesh, cfg).spec
    rows = RULES["batch"]
    q_spec = PartitionSpec(rows, pool[0], None)
    meta_spec = StepMetadata(positions=PartitionSpec(rows), slot_mapping=PartitionSpec(rows),
                             kv_lens=PartitionSpec(rows), block_tables=PartitionSpec(rows, None),
                             query_start=PartitionSpec(rows), num_seqs=PartitionSpec(rows))

    def sharded(q, k_pool, v_pool, layer, meta, **options):
        window = options.pop("sliding_window")  # an array: an argument of the shard_map, not a constant
        local = lambda q, k, v, layer, window, meta: attend(q, k, v, layer, meta, sliding_window=window,  # noqa: E731
                                                            **options)
        return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, pool, pool, PartitionSpec(), PartitionSpec(),
                                                         meta_spec),
                             out_specs=q_spec, check_vma=False)(q, k_pool, v_pool, layer, window, meta)
    return sharded


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def place(x, sharding: NamedSharding) -> jax.Array:
    """Puts a host or device array into `sharding`, also when the sharding spans other processes
    (every process passes the same value and provides only its own devices' shards)."""
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_tree(tree, shardings):
    return jax.tree.map(place, tree, shardings)


def bytes_per_device(tree) -> int:
    """Bytes the first addressable device holds of every array in `tree`."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.addressable_shards[0]
        total += math.prod(shard.data.shape) * x.dtype.itemsize
    return total
