"""Prometheus metrics of one server: a registry of its own (two apps in one process never clash).

They live in the API process. The engine client's receiver thread updates them from the engine
core's messages (`observe_engine` with the stats sent after each step, `observe_finished` with the
timings of each finished request); HTTP handlers count rejections and render the text format.
Names follow the vLLM vocabulary: TTFT, TPOT (time per output token after the first), end-to-end
latency, queue time. The gauges a router scores replicas by are also exported under vLLM's own
names (the Gateway API Inference Extension's model server protocol, which llm-d's scheduler
follows): `vllm:num_requests_waiting`, `vllm:num_requests_running`, and KV-cache use as a fraction
under both `vllm:kv_cache_usage_perc` (vLLM V1, the protocol today) and `vllm:gpu_cache_usage_perc`
(older vLLM, which earlier scheduler releases read).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.running = Gauge("jaxserve_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("jaxserve_num_requests_waiting", "Requests in the waiting queue", registry=r)
        self.kv_pages_used = Gauge("jaxserve_kv_pages_used", "KV pages held by sequences", registry=r)
        self.kv_pages_cached = Gauge("jaxserve_kv_pages_cached",
                                     "KV pages held by no sequence but keeping a prefix-cache page", registry=r)
        self.prefix_cache_queries = Counter("jaxserve_prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_cache_hits = Counter("jaxserve_prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache", registry=r)
        self.kv_pages_total = Gauge("jaxserve_kv_pages_total", "KV pages in the pool (null page excluded)",
                                    registry=r)
        self.kv_usage = Gauge("jaxserve_kv_cache_usage_percent", "KV pages in use, percent of the pool", registry=r)
        self.kv_group_pages = Gauge("jaxserve_kv_group_pages", "KV pages of one KV-cache group (full attention or "
                                    "a sliding window), used or cached", ["group", "window", "state"], registry=r)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed", registry=r)
        self.vllm_running = Gauge("vllm:num_requests_running", "Requests in the running batch", registry=r)
        self.vllm_kv_usage = [Gauge(name, "KV-cache usage: KV pages in use, 1 means the whole pool", registry=r)
                              for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")]
        self.prompt_tokens = Counter("jaxserve_prompt_tokens", "Prompt tokens accepted, each prompt once whatever "
                                     "its n (as in usage)", registry=r)
        self.generation_tokens = Counter("jaxserve_generation_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter("jaxserve_num_preemptions", "Sequences preempted for lack of KV pages",
                                   registry=r)
        self.compiles = Counter("jaxserve_num_compiles", "XLA compilations of prefill and decode steps",
                                registry=r)
        self.mask_seconds = Counter("jaxserve_structured_output_mask_seconds",
                                    "Host time filling structured-output token masks (llguidance), all steps",
                                    registry=r)
        self.mask_steps = Counter("jaxserve_structured_output_mask_steps",
                                  "Steps that filled a structured-output token mask (mean per step: the "
                                  "seconds counter over this one)", registry=r)
        self.spec_drafts = Counter("jaxserve_spec_decode_num_drafts",
                                   "Speculative drafts verified (one per request and step)", registry=r)
        self.spec_draft_tokens = Counter("jaxserve_spec_decode_num_draft_tokens", "Speculative draft tokens verified",
                                         registry=r)
        self.spec_accepted_tokens = Counter("jaxserve_spec_decode_num_accepted_tokens",
                                            "Speculative draft tokens accepted (acceptance rate: over the draft "
                                            "tokens counter)", registry=r)
        self.engine_errors = Counter("jaxserve_engine_step_errors", "Engine steps that failed", registry=r)
        self.engine_restarts = Counter("jaxserve_engine_restarts",
                                       "Engine processes started again after the previous one died", registry=r)
        self.finished = Counter("jaxserve_requests_finished", "Requests ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("jaxserve_requests_rejected", "HTTP requests refused, by status code",
                                ["status"], registry=r)
        self.ttft = Histogram("jaxserve_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("jaxserve_time_per_output_token_seconds", "Mean time per token after the first",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.api_ttft = Histogram("jaxserve_api_time_to_first_token_seconds",
                                  "Arrival to the first token reaching its HTTP handler (engine TTFT plus the "
                                  "rest of its step and the channel)", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jaxserve_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.handoff_time = Histogram("jaxserve_request_handoff_seconds",
                                      "Arrival to the engine loop taking the request (the channel, and the "
                                      "engine step it arrived during)", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("jaxserve_request_queue_time_seconds", "Arrival to first admission",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self._seen = {"num_compiles": 0, "num_preemptions": 0, "num_errors": 0, "prefix_cache_queries": 0,
                      "prefix_cache_hits": 0, "structured_output_mask_seconds": 0, "structured_output_mask_steps": 0,
                      "spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                      "spec_decode_num_accepted_tokens": 0}

    def engine_replaced(self) -> None:
        """A new engine counts from 0: its counters advance the exported ones from there."""
        self._seen = dict.fromkeys(self._seen, 0)

    def observe_engine(self, stats: dict) -> None:
        """Mirrors `Engine.stats()`: gauges are set, engine counters advance by their increase."""
        for gauge in (self.running, self.vllm_running):
            gauge.set(stats["running"])
        for gauge in (self.waiting, self.vllm_waiting):
            gauge.set(stats["waiting"])
        total, used = stats["total_pages"], stats["used_pages"]
        self.kv_pages_used.set(used)
        self.kv_pages_cached.set(stats["cached_pages"])
        self.kv_pages_total.set(total)
        usage = used / total if total else 0.0
        self.kv_usage.set(100.0 * usage)
        for gauge in self.vllm_kv_usage:
            gauge.set(usage)
        for g, group in enumerate(stats.get("kv_groups", ())):
            window = "full" if group["window"] is None else str(group["window"])
            for state in ("used", "cached"):
                self.kv_group_pages.labels(group=str(g), window=window, state=state).set(group[f"{state}_pages"])
        for key, counter in (("num_compiles", self.compiles), ("num_preemptions", self.preemptions),
                             ("num_errors", self.engine_errors), ("prefix_cache_queries", self.prefix_cache_queries),
                             ("prefix_cache_hits", self.prefix_cache_hits),
                             ("structured_output_mask_seconds", self.mask_seconds),
                             ("structured_output_mask_steps", self.mask_steps),
                             ("spec_decode_num_drafts", self.spec_drafts),
                             ("spec_decode_num_draft_tokens", self.spec_draft_tokens),
                             ("spec_decode_num_accepted_tokens", self.spec_accepted_tokens)):
            value = stats.get(key, 0)
            if value > self._seen[key]:
                counter.inc(value - self._seen[key])
                self._seen[key] = value

    def observe_finished(self, reason: str, timings: dict[str, float | None] | None) -> None:
        """Records a finished request: its finish reason and, in seconds from arrival, its handoff
        to the engine loop, queue time, TTFT and end-to-end latency, plus its TPOT (any of them None when unknown)."""
        self.finished.labels(finish_reason=reason).inc()
        t = timings or {}
        if t.get("handoff") is not None:
            self.handoff_time.observe(t["handoff"])
        if t.get("queue") is not None:
            self.queue_time.observe(t["queue"])
        if t.get("ttft") is not None:
            self.ttft.observe(t["ttft"])
        if reason in ("stop", "length"):
            if t.get("e2e") is not None:
                self.e2e.observe(t["e2e"])
            if t.get("tpot") is not None:
                self.tpot.observe(t["tpot"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
