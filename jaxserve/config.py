"""EngineConfig: what the user chooses. Values derived at start-up live in the engine."""

from __future__ import annotations

import dataclasses

from jaxserve.engine.batching.policies import STRATEGIES

DTYPES = ("auto", "float32", "bfloat16")
QUANTIZATIONS = (None, "int8", "w8a8", "auto")  # jaxserve.model.quantization; "auto": measured here
BACKENDS = ("auto", "pallas", "reference")  # "auto" and pallas_kernels.IMPLEMENTATIONS (jax-free here)


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding (`jaxserve.engine.batching.speculation`), in the shape of vLLM's
    `--speculative-config`: each decoding sequence drafts up to `num_speculative_tokens` tokens,
    which one step verifies. "ngram": the tokens that followed the sequence's last
    `prompt_lookup_max` .. `prompt_lookup_min` tokens where they last occurred in it before.
    "draft_model": the greedy tokens of `model`, a smaller checkpoint of the same vocabulary
    (`jaxserve.engine.draft_model`).
    Drafting pauses for a request whose drafts are accepted less than `min_acceptance` of the time
    (it tries again `retry_steps` steps later), and for every request while more than
    `max_batch` run (a large batch fills the device without it)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    min_acceptance: float = 0.3
    retry_steps: int = 32
    max_batch: int = 8
    model: str | None = None  # draft_model: the draft's checkpoint (a folder or a .gguf)

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError('speculative "model" names the draft model\'s checkpoint: the draft_model method needs '
                             'one, and the ngram method takes none')
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "retry_steps", "max_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"speculative {name} must be an integer > 0, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if not 0 <= self.min_acceptance <= 1:
            raise ValueError(f"speculative min_acceptance must be in [0, 1], got {self.min_acceptance!r}")

    @classmethod
    def of(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """From a dict (vLLM's JSON keys), unknown keys refused."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative must be a dict or a SpeculativeConfig, got {value!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative: unknown key(s) {unknown}; known: {sorted(names)}")
        return cls(**value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Engine options, validated on construction.

    The KV pool holds `num_pages` pages if given, else as many as fit in `kv_cache_bytes`; left
    unset, that is 1 GiB on a CPU and, on an accelerator, `gpu_memory_utilization` of the device's
    memory less what the weights took (as vLLM's `--gpu-memory-utilization`). The budget holds per
    memory: each accelerator's share of the pool, or, on a CPU, the shards of all its devices.
    `max_model_len=None` takes the model's context if the KV pool holds one sequence of it, else the
    longest sequence it holds; an explicit `max_model_len` the pool cannot hold is a ValueError.
    """

    strategy: str = "paged"
    max_slots: int = 32
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9  # accelerators: the share of device memory weights and KV may take
    max_model_len: int | None = None
    dtype: str = "auto"  # weights; "auto": what fits the machine (`jaxserve.worker.machine`)
    kv_cache_dtype: str = "auto"  # the KV pool; "auto": the weights' dtype
    # int8 weights, read in `dtype` ("int8") or with int8 activations ("w8a8"); "auto": int8 where
    # it decodes clearly faster on this machine, else None (`jaxserve.worker.quantization_plan`)
    quantization: str | None = None
    attention_backend: str = "auto"
    seed: int = 0
    batch_size: int = 8  # dynamic batching: close a batch at this many requests ...
    max_batch_delay_ms: float = 50.0  # ... or this long after its first request
    max_num_batched_tokens: int = 256  # the token budget of one step (see the README for why 256)
    enable_chunked_prefill: bool = True  # False: a prompt runs whole in one step (the step grows to fit)
    enable_prefix_caching: bool = True  # share the K/V of prompts' common leading pages
    # Schedule and dispatch step N+1 before step N's tokens reach the host. None: on accelerators
    # only (on a 2-core CPU the host thread competes with XLA's: steps in order ran 5% faster).
    async_scheduling: bool | None = None
    # Decode steps one dispatch runs when every running request decodes (sampling and the EOS,
    # stop-id and max_tokens checks on the device); a request that arrives meanwhile waits for them.
    decode_steps: int = 1
    max_waiting: int = 1024  # bound of the waiting queue (the server answers 429 past it)
    mesh: dict[str, int] | None = None  # e.g. {"data": 2, "model": 4}; None: one device
    speculative: SpeculativeConfig | None = None  # or a dict of its fields (vLLM's --speculative-config)

    def __post_init__(self):
        object.__setattr__(self, "speculative", SpeculativeConfig.of(self.speculative))
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        for name in ("dtype", "kv_cache_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {DTYPES}, got {getattr(self, name)!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        if self.kv_cache_bytes is not None and (not isinstance(self.kv_cache_bytes, int) or self.kv_cache_bytes <= 0):
            raise ValueError(f"kv_cache_bytes must be an integer > 0, got {self.kv_cache_bytes!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("max_slots", "page_size", "batch_size", "max_num_batched_tokens", "max_waiting", "decode_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be an integer > 0, got {value!r}")
        if self.max_num_batched_tokens < self.max_slots:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_slots "
                             f"({self.max_slots}): every running sequence decodes one token per step")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True, False or None, got {self.async_scheduling!r}")
        for name in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 2):
            raise ValueError(f"num_pages must be an integer >= 2 (page 0 is the null page), got {self.num_pages!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len <= 0):
            raise ValueError(f"max_model_len must be an integer > 0, got {self.max_model_len!r}")
        if self.max_batch_delay_ms < 0:
            raise ValueError(f"max_batch_delay_ms must be >= 0, got {self.max_batch_delay_ms!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.mesh is not None and any(not isinstance(v, int) or v <= 0 for v in self.mesh.values()):
            raise ValueError(f"mesh axis sizes must be integers > 0, got {self.mesh!r}")

    @property
    def weights_dtype(self) -> str:
        """The dtype the weights are loaded in: "auto" is bfloat16 on accelerators and on CPUs with
        bfloat16 dot instructions, float32 elsewhere (`jaxserve.worker.machine`), and on a CPU a bucket's
        programs may run on a copy in the other dtype (`jaxserve.worker.dtype_plan`); float32 gives exact
        parity with Hugging Face."""
        if self.dtype == "auto":
            from jaxserve.worker.machine import auto_weights_dtype
            return auto_weights_dtype()[0]
        return self.dtype

    @property
    def overlaps_steps(self) -> bool:
        """Whether steps overlap (async scheduling): as asked, else on accelerators only."""
        if self.async_scheduling is None:
            from jaxserve.worker.machine import auto_async_scheduling
            return auto_async_scheduling()
        return self.async_scheduling

    @property
    def kv_dtype(self) -> str:
        return self.weights_dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def step_token_budget(self, max_model_len: int) -> int:
        """Tokens one step may run. Without chunked prefill a whole prompt must fit beside every
        running decode, so the step grows to max_model_len + max_slots."""
        if self.enable_chunked_prefill:
            return self.max_num_batched_tokens
        return max(self.max_num_batched_tokens, max_model_len + self.max_slots)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
