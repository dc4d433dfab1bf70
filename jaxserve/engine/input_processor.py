"""Prompts and sampling parameters in, validated Requests out: text is tokenized, token ids and
lengths are checked against the model, and each request gets its id, its seed and its group.
Every bad input is a ValueError that names the field and the limit, raised before anything is
queued.
"""

from __future__ import annotations

import itertools
import random
import time

import numpy as np

from jaxserve.engine.batching import Request, SamplingParams
from jaxserve.model.config import ModelConfig
from jaxserve.tokenizer import Tokenizer

Prompt = str | list[int]


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, model_config: ModelConfig, max_model_len: int, seed: int):
        self.tokenizer, self.model_config, self.max_model_len = tokenizer, model_config, max_model_len
        self._seeds = random.Random(seed)  # a request without a seed draws one here
        self._ids = itertools.count()
        self._groups = itertools.count(1)

    def new_group(self) -> int:
        """A group of its own: requests of one payload share one (static batching)."""
        return next(self._groups)

    def request(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None = None,
                group: int | None = None, arrival_time: float | None = None, cache_salt: str | None = None) -> Request:
        """The Request of one prompt (ValueError on bad input). `arrival_time` (time.monotonic)
        backdates a request that arrived while a step ran."""
        params = params or SamplingParams()
        token_ids = self.token_ids(prompt, params)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        return Request(request_id or f"req-{next(self._ids)}", token_ids, params, seed,
                       arrival_time or time.monotonic(), group=self.new_group() if group is None else group,
                       cache_salt=cache_salt)

    def token_ids(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, checked with its parameters against the model and the context."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        vocab = self.model_config.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids instead of text")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            token_ids = [int(t) for t in prompt]
            if not token_ids:
                raise ValueError("prompt must not be empty")
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; the context (max_model_len) is "
                             f"{self.max_model_len}, leaving no room to generate")
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                             f"context (max_model_len={self.max_model_len})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be < vocab size {vocab}")
        return token_ids


def as_prompt_list(prompts) -> list[Prompt]:
    """`generate`'s prompts as a list: one string, a list of strings, one token-id list or a list of them."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, (int, np.integer)) for t in prompts):
        return [list(prompts)]  # one token-id prompt
    if isinstance(prompts, (list, tuple)) and prompts:
        return list(prompts)
    raise ValueError("prompts must be a string, a list of strings or a list of token-id lists, and not empty")
