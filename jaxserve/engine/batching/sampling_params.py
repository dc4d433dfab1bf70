"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import dataclasses

from jaxserve.engine.batching.structured_outputs import StructuredOutputs

MAX_LOGPROBS = 5  # top alternatives the runner can return per token


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request samples. `temperature=0` means greedy; `seed=None` draws a seed at submit."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on the detokenized text
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's logprob plus the top k
    structured_outputs: StructuredOutputs | None = None  # the output must match this (JSON schema, regex, ...)

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be an integer > 0, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be an integer in [0, 2**31) (0 disables it), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError(f"structured_outputs must be a StructuredOutputs, got "
                             f"{type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
