"""One generation request as the scheduler tracks it, and the result handed back to callers."""

from __future__ import annotations

import dataclasses
import enum

from jaxserve.engine.batching.sampling_params import SamplingParams


PENDING = -1  # stands for a sampled token that is still on the device


class SlotCounter:
    """A counter that steps move: while its request holds a slot, it lives in the scheduler's
    arrays by slot (`SlotCounters`, the attribute of the same name), so that a step moves every
    decode's at once; otherwise on the request, as `_<name>`."""

    def __init__(self, flag: bool = False):
        self.flag = flag  # kept there as 0 or 1, read as a bool

    def __set_name__(self, owner, name):
        self.name, self.field = name, "_" + name

    def __get__(self, request, owner=None):
        if request is None:
            return self
        counters = request.counters
        if counters is None:
            return getattr(request, self.field)
        value = getattr(counters, self.name).item(request.slot)  # a Python int
        return bool(value) if self.flag else value

    def __set__(self, request, value):
        counters = request.counters
        if counters is None:
            setattr(request, self.field, value)
        else:
            getattr(counters, self.name)[request.slot] = value


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"
    ERROR = "error"


@dataclasses.dataclass(eq=False, slots=True)
class Request:
    """Mutable host-side state of one sequence.

    `num_computed_tokens` counts the tokens whose K/V are in the pool: a prompt advances chunk by
    chunk, and a sequence decodes once only its last sampled token is left to compute. A token
    sampled by a step whose results have not reached the host yet is pending: it counts in
    `num_tokens` (the next step can already compute it, from the device) but is not in
    `output_token_ids`; `stopping` marks a request whose pending token is its last. `pages` holds
    one block table per KV-cache group (see `kv_cache_manager`), empty while it holds none. `page_hashes`
    are the content hashes of its full pages (prefix caching), `cache_salt` keeps tenants apart.
    `seed` is resolved at submission, so sampling keys derive from (seed, position) even when the
    caller gave none. `group` ties the prompts of one client payload together (static batching).
    The counters a step moves (`SlotCounter`s) are the scheduler's arrays while it holds a slot.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float
    group: int = 0
    cache_salt: str | None = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None  # why it ended with `error`, when its own input was the cause (its grammar)
    slot: int | None = None
    pages: list[list[int]] = dataclasses.field(default_factory=list)  # per group: page ids, 0 out of its window
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    first_token_time: float | None = None
    finish_time: float | None = None
    admit_time: float | None = None  # first admission, for queue-time metrics
    num_preemptions: int = 0
    num_prompt_tokens: int = dataclasses.field(init=False)  # the prompt never changes: counted once
    max_num_tokens: int = dataclasses.field(init=False)  # where it stops for length (the scheduler caps it at the context)
    counters: object = dataclasses.field(default=None, repr=False)  # the scheduler's SlotCounters while it holds a slot
    _num_table_tokens: int = dataclasses.field(default=0, repr=False)
    _next_window_drop: int = dataclasses.field(default=0, repr=False)
    _num_computed_tokens: int = dataclasses.field(default=0, repr=False)
    _num_pending_tokens: int = dataclasses.field(default=0, repr=False)
    _stopping: bool = dataclasses.field(default=False, repr=False)
    _num_cached_pages: int = dataclasses.field(default=0, repr=False)

    num_table_tokens = SlotCounter()  # the tokens every group's table reaches: past them a step needs new pages
    next_window_drop = SlotCounter()  # computed tokens at which a sliding window next leaves a page behind
    num_computed_tokens = SlotCounter()
    num_pending_tokens = SlotCounter()
    stopping = SlotCounter(flag=True)  # its pending token is its last
    num_cached_pages = SlotCounter()  # leading pages recorded in the prefix cache

    def __post_init__(self):
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.max_num_tokens = self.num_prompt_tokens + self.params.max_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output (PENDING for a token still on the device),
        without copying the whole sequence."""
        prompt = self.num_prompt_tokens
        known = prompt + len(self.output_token_ids)
        if stop == start + 1:  # a decode's one token (most calls)
            return [PENDING if start >= known else self.prompt_token_ids[start] if start < prompt
                    else self.output_token_ids[start - prompt]]
        pending = [PENDING] * (stop - max(start, known)) if stop > known else []
        if start >= prompt:
            return self.output_token_ids[start - prompt: stop - prompt] + pending
        return self.prompt_token_ids[start: stop] + self.output_token_ids[: max(0, stop - prompt)] + pending

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def keep_output(self, n: int) -> None:
        """Drops the output after its first `n` tokens, and their logprobs: tokens one step kept
        past where the output ends (a stop string or a grammar completed inside kept drafts)."""
        del self.output_token_ids[n:]
        del self.logprobs[n:]


@dataclasses.dataclass
class RequestOutput:
    """What `Engine.generate` returns and `Engine.stream` yields (text and tokens so far)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    ttft_s: float | None
    latency_s: float | None
    logprobs: list[dict] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # why it ended with `error`, when its own input was the cause (its grammar)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
