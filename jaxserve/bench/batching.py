"""Benchmark the five batching strategies on one workload, side by side.

    python scripts/bench_batching.py --num-requests 64 --input-len 32:256 --output-len 128:128 \
        --strategies none,dynamic,continuous,paged --peer hf --json bench.json --plot bench.png
    python scripts/bench_batching.py --num-requests 16 --long-prompts 3:1500 --strategies paged \
        --max-model-len 2048 --no-chunked-prefill      # ITL of decoding requests while long prompts arrive

One process builds one engine; every strategy reuses its model, compiled steps and KV pool
(`Engine.with_strategy`), so the runs differ in scheduling only. All shapes are compiled before the
timed runs (the compile time is reported on its own), and each run reports the compiles it caused.
Requests arrive all at once (`--rate inf`) or as a Poisson process; output lengths are fixed by
`ignore_eos`. `--peer hf` and `--peer llamacpp` run the same requests through Hugging Face
transformers (static padded batches) and llama-cpp-python (batched decoding) as baseline rows.
`--long-prompts COUNT:LEN` sends COUNT prompts of LEN tokens once every other request is
decoding; the ITL columns (inter-token latency p50, p99, max) are those of the other requests.
`--no-chunked-prefill` adds rows from a second engine that prefills every prompt whole, and
`--no-prefix-caching` rows with the prefix cache off. `--timeline PNG` draws one panel per run: which
request held which slot when (prompt chunks hatched), with KV use underneath (jaxserve/bench/timeline.py). `--shared-prefix-len N` gives every prompt
the same first N tokens (then `--input-len` tokens of its own) and implies `--no-prefix-caching`.
`--rounds N` runs every engine and peer N times in turn and prints each run's median and its
ratios to the others within a round (this machine's speed drifts between minutes). The "pad"
column is tokens computed (bucket padding included) per real token, "hits" the share of prompt
tokens found in the prefix cache, "KV B/token" the KV bytes the running sequences hold per
token of theirs (time-weighted: sliding-window layers keep only their window, so it falls as
sequences grow).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import time

import jax
import numpy as np
from tqdm import tqdm

from jaxserve import Engine, EngineConfig, SamplingParams
from jaxserve.bench import trace_busy
from jaxserve.bench.step_profile import StepProfile
from jaxserve.bench.timeline import TimelineRecorder, plot_timelines
from jaxserve.entrypoints.engine_args import quantization_arg
from jaxserve.host_memory import keep_freed_memory


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]  # seconds after the start
    late: list[int] = dataclasses.field(default_factory=list)  # sent once every other request decodes


def held_tokens(running, page_size: int) -> int:
    """Tokens held in the pool by the running requests, a page shared by several counted once."""
    filled: dict[int, int] = {}
    for r in running:
        for table in r.pages:  # one per KV-cache group; 0: a page a sliding window dropped
            for i, page in enumerate(table):
                if page:
                    filled[page] = max(filled.get(page, 0), min(page_size, r.num_tokens - i * page_size), 0)
    return sum(filled.values())


def make_workload(args, vocab_size: int) -> Workload:
    rng = np.random.default_rng(args.seed)
    lo, hi = args.input_len
    olo, ohi = args.output_len
    n = args.num_requests
    words = (min(1000, vocab_size // 4), min(vocab_size, 200_000))  # skip the low ids where special tokens live
    prefix = rng.integers(*words, size=args.shared_prefix_len).tolist()
    prompts = [prefix + rng.integers(*words, size=rng.integers(lo, hi + 1)).tolist() for _ in range(n)]
    output_lens = rng.integers(olo, ohi + 1, size=n).tolist()
    if math.isinf(args.rate):
        arrivals = [0.0] * n
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / args.rate, size=n)).tolist()
    count, length = args.long_prompts or (0, 0)
    late = list(range(n, n + count))
    prompts += [rng.integers(*words, size=length).tolist() for _ in late]
    output_lens += [olo] * count
    arrivals += [math.inf] * count
    return Workload(prompts, output_lens, arrivals, late)


def percentile(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def run_strategy(engine: Engine, strategy: str, work: Workload, args, caching: bool = True,
                 overlap: bool | None = None, timelines: list | None = None) -> dict:
    """Replays the workload's arrivals against one strategy; returns its row of figures (and
    appends the run's slot timeline to `timelines`, if given)."""
    eng = engine.with_strategy(strategy, batch_size=args.batch_size, max_batch_delay_ms=args.max_batch_delay_ms,
                               enable_prefix_caching=caching, async_scheduling=overlap)
    stats0 = eng.stats()
    order = sorted(range(len(work.prompts) - len(work.late)), key=lambda i: work.arrivals[i])
    ids: dict[int, str] = {}
    token_times: dict[str, list[float]] = {}  # when each request's tokens reached the host
    next_i, late_sent = 0, not work.late
    usage = _KVUsage(eng)
    bar = tqdm(total=len(work.prompts), desc=f"{strategy:>10}", leave=False, file=sys.stderr, disable=None)
    profile = StepProfile(eng).__enter__()  # host time per step and device idle share
    trace_dir = args.trace and os.path.join(args.trace, re.sub(r"\W+", "-", _label(eng, caching, overlap)))
    tracing = jax.profiler.trace(trace_dir) if trace_dir else contextlib.nullcontext()
    tracing.__enter__()
    start = time.monotonic()
    numbers: dict[str, int] = {}  # request id -> workload index, for the timeline's colours
    recorder = TimelineRecorder(_label(eng, caching, overlap), eng, start, numbers) if timelines is not None else None

    def send(payload, group, arrival):
        for i in payload:
            params = SamplingParams(max_tokens=work.output_lens[i], temperature=0, ignore_eos=True)
            ids[i] = eng.add_request(work.prompts[i], params, group=group, arrival_time=arrival)
            token_times[ids[i]] = []
            numbers[ids[i]] = i

    while next_i < len(order) or eng.has_unfinished() or not late_sent:
        now = time.monotonic() - start
        while next_i < len(order) and work.arrivals[order[next_i]] <= now:
            # A static payload is the next batch_size requests; it is sent when its last one arrives.
            if strategy == "static":
                payload = order[next_i: next_i + args.batch_size]
                if work.arrivals[payload[-1]] > now:
                    break
            else:
                payload = [order[next_i]]
            send(payload, next_i, start + work.arrivals[payload[-1]])  # one group per payload
            next_i += len(payload)
        if not late_sent and next_i == len(order) and all(token_times[ids[i]] for i in order):
            send(work.late, -1, time.monotonic())
            late_sent = True
        if not eng.has_unfinished():
            time.sleep(max(0.0, min(0.01, work.arrivals[order[min(next_i, len(order) - 1)]] - now)))
            continue
        if recorder:
            recorder.before_step(eng)
        t0 = time.monotonic()
        done = eng.step()
        t1 = time.monotonic()
        if recorder:
            recorder.after_step(eng, t0, t1, done)
        for r in eng.scheduler.running + done:
            times = token_times[r.request_id]
            times += [t1] * (len(r.output_token_ids) - len(times))
        usage.observe(eng, t1 - t0)
        bar.update(len(done))
        if eng.idle:
            time.sleep(0.0005)
    bar.close()
    profile.__exit__(None, None, None)
    tracing.__exit__(None, None, None)
    if recorder:
        timelines.append(recorder.timeline)
    requests = [eng.request(ids[i]) for i in sorted(ids)]
    itl = [b - a for i in order for a, b in zip(token_times[ids[i]], token_times[ids[i]][1:])]
    row = _figures(eng, _label(eng, caching, overlap), requests, itl, start, stats0, usage, profile)
    busy = trace_busy.device_busy(trace_busy.load(trace_dir)) if trace_dir else []
    if busy:  # the first device's (a CPU's trace has none: XLA works on the host's threads)
        row["device_busy_traced"] = busy[0]["busy_share"]
    return row


class _KVUsage:
    """What the running sequences held over a run, weighted by step time: the peak count, the share
    of reserved KV slots holding a token, and the KV bytes per held token."""

    def __init__(self, eng: Engine):
        self.page_size = eng.config.page_size
        self.page_bytes = sum(x.nbytes for x in eng.runner.kv_pool) / eng.runner.config.num_pages  # all layers, K, V
        self.peak, self.kv_weighted, self.kv_time, self.bytes_weighted, self.bytes_time = 0, 0.0, 0.0, 0.0, 0.0

    def observe(self, eng: Engine, dt: float) -> None:
        running = eng.scheduler.running
        self.peak = max(self.peak, len(running))
        reserved = eng.blocks.used_pages * self.page_size
        if reserved:
            self.kv_weighted += dt * held_tokens(running, self.page_size) / reserved
            self.kv_time += dt
        tokens = sum(r.num_tokens for r in running)
        if tokens:  # sliding-window groups hold only their window: fewer bytes per token as sequences grow
            self.bytes_weighted += dt * eng.blocks.used_pages * self.page_bytes / tokens
            self.bytes_time += dt


def _figures(eng: Engine, label: str, requests, itl: list[float], start: float, stats0: dict, usage: _KVUsage,
             profile: StepProfile) -> dict:
    """The run's row: throughput, latencies, KV use, padding, host time, and that no page leaked."""
    makespan = max(r.finish_time for r in requests) - start
    ttft = [r.first_token_time - r.arrival_time for r in requests]
    e2e = [r.finish_time - r.arrival_time for r in requests]
    tpot = [(r.finish_time - r.first_token_time) / (len(r.output_token_ids) - 1)
            for r in requests if len(r.output_token_ids) > 1]
    out_tokens = sum(len(r.output_token_ids) for r in requests)
    stats = eng.stats()
    assert stats["used_pages"] == 0 and stats["free_pages"] + stats["cached_pages"] == stats["total_pages"], \
        "KV pages leaked"
    queries = stats["prefix_cache_queries"] - stats0["prefix_cache_queries"]
    return {
        "strategy": label,
        "requests_per_s": len(requests) / makespan,
        "output_tokens_per_s": out_tokens / makespan,
        "ttft_mean_s": float(np.mean(ttft)), "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_mean_s": float(np.mean(tpot)), "tpot_p99_s": percentile(tpot, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99), "itl_max_s": max(itl, default=math.nan),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "peak_concurrent": usage.peak,
        "kv_utilization": usage.kv_weighted / usage.kv_time if usage.kv_time else float("nan"),
        "kv_bytes_per_token": usage.bytes_weighted / usage.bytes_time if usage.bytes_time else float("nan"),
        "prefix_hit_rate": (stats["prefix_cache_hits"] - stats0["prefix_cache_hits"]) / queries if queries else 0.0,
        "padding": (stats["tokens_computed"] - stats0["tokens_computed"]) / (stats["tokens_run"] - stats0["tokens_run"]),
        "host_ms_per_step": profile.host_ms_per_step()["host"],
        "host_ms_by_part": profile.host_ms_per_step(),
        "device_idle_share": profile.device_idle_share(),
        "preemptions": stats["num_preemptions"] - stats0["num_preemptions"],
        "compiles_during_run": stats["num_compiles"] - stats0["num_compiles"],
        "makespan_s": makespan,
    }


def _label(eng: Engine, caching: bool, overlap: bool | None) -> str:
    """The strategy, and what this run changed from the engine's defaults."""
    return (eng.config.strategy + ("" if eng.config.enable_chunked_prefill else " (no chunked prefill)")
            + ("" if eng.config.decode_steps == 1 else f" ({eng.config.decode_steps} decode steps)")
            + ("" if eng.runner.quant is None else f" ({eng.runner.quant.mode} weights)")
            + ("" if caching else " (no prefix caching)")
            + {None: "", False: " (steps in order)", True: " (steps overlapped)"}[overlap])


def run_hf_peer(model_path: str | None, work: Workload, args) -> dict:
    """Hugging Face transformers: static padded batches of batch_size (float32 with torch on CPU,
    bfloat16 on a CUDA GPU)."""
    import torch
    import transformers
    from jaxserve.model.default_model import default_model_path
    torch.set_num_threads(os.cpu_count())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    path = model_path or default_model_path()
    if path.endswith(".gguf"):
        folder, name = os.path.split(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.to(device).eval()
    pad = 0
    order = list(range(len(work.prompts)))
    start = time.monotonic()
    finish, first = {}, {}
    with torch.no_grad():
        for b in tqdm(range(0, len(order), args.batch_size), desc="        hf", leave=False, file=sys.stderr, disable=None):
            batch = order[b: b + args.batch_size]
            width = max(len(work.prompts[i]) for i in batch)
            ids = torch.tensor([[pad] * (width - len(work.prompts[i])) + work.prompts[i] for i in batch])
            mask = (torch.arange(width)[None] >= torch.tensor([width - len(work.prompts[i]) for i in batch])[:, None]).long()
            ids, mask = ids.to(device), mask.to(device)
            new = max(work.output_lens[i] for i in batch)
            t0 = time.monotonic()
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           eos_token_id=None, pad_token_id=pad)
            for i in batch:
                finish[i] = time.monotonic() - start
                first[i] = t0 - start  # lower bound: HF returns the batch at once
    makespan = max(finish.values())
    out_tokens = sum(work.output_lens)
    e2e = [finish[i] for i in order]
    return {"strategy": "peer:hf-static", "requests_per_s": len(order) / makespan,
            "output_tokens_per_s": out_tokens / makespan, "e2e_p50_s": percentile(e2e, 50),
            "e2e_p99_s": percentile(e2e, 99), "makespan_s": makespan, "peak_concurrent": args.batch_size}


def run_llamacpp_peer(model_path: str | None, work: Workload, args) -> dict:
    """llama-cpp-python on the same GGUF: one batch of up to max_slots sequences decoded together."""
    from jaxserve.bench.llamacpp_peer import generate_batched
    from jaxserve.model.default_model import default_model_path
    path = model_path or default_model_path()
    if not path.endswith(".gguf"):
        raise SystemExit("--peer llamacpp needs a .gguf model")
    finish = generate_batched(path, work.prompts, work.output_lens, max_batch=args.max_slots,
                              threads=os.cpu_count())
    makespan = max(finish)  # from the first decode: its model load is not timed, as the engine's is not
    e2e = list(finish)
    return {"strategy": "peer:llamacpp", "requests_per_s": len(work.prompts) / makespan,
            "output_tokens_per_s": sum(work.output_lens) / makespan, "e2e_p50_s": percentile(e2e, 50),
            "e2e_p99_s": percentile(e2e, 99), "makespan_s": makespan,
            "peak_concurrent": min(args.max_slots, len(work.prompts))}


COLUMNS = [("strategy", "strategy", "{}"), ("req/s", "requests_per_s", "{:.2f}"),
           ("out tok/s", "output_tokens_per_s", "{:.1f}"), ("TTFT mean", "ttft_mean_s", "{:.2f}"),
           ("TTFT p50", "ttft_p50_s", "{:.2f}"), ("TTFT p99", "ttft_p99_s", "{:.2f}"),
           ("TPOT mean", "tpot_mean_s", "{:.3f}"), ("TPOT p99", "tpot_p99_s", "{:.3f}"),
           ("ITL p50", "itl_p50_s", "{:.3f}"), ("ITL p99", "itl_p99_s", "{:.3f}"), ("ITL max", "itl_max_s", "{:.3f}"),
           ("E2E p50", "e2e_p50_s", "{:.2f}"), ("E2E p99", "e2e_p99_s", "{:.2f}"),
           ("peak seqs", "peak_concurrent", "{}"), ("KV util", "kv_utilization", "{:.1%}"),
           ("KV B/token", "kv_bytes_per_token", "{:.0f}"), ("pad", "padding", "{:.3f}"),
           ("hits", "prefix_hit_rate", "{:.1%}"),
           ("host ms/step", "host_ms_per_step", "{:.1f}"), ("device idle", "device_idle_share", "{:.1%}"),
           ("busy (trace)", "device_busy_traced", "{:.1%}"),
           ("preempt", "preemptions", "{}"), ("compiles", "compiles_during_run", "{}")]


def print_table(rows: list[dict]) -> None:
    cells = [[title for title, _, _ in COLUMNS]]
    for row in rows:
        cells.append([fmt.format(row[key]) if key in row else "-" for _, key, fmt in COLUMNS])
    widths = [max(len(r[c]) for r in cells) for c in range(len(COLUMNS))]
    for i, r in enumerate(cells):
        print("| " + " | ".join(v.rjust(w) for v, w in zip(r, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def plot(rows: list[dict], sweep: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3 if sweep else 2, figsize=(15 if sweep else 10, 4))
    names = [r["strategy"] for r in rows]
    axes[0].bar(names, [r["output_tokens_per_s"] for r in rows])
    axes[0].set_title("output tokens/s")
    axes[1].bar(names, [r["e2e_p99_s"] for r in rows], color="tab:orange")
    axes[1].set_title("end-to-end latency p99 (s)")
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=30)
    if sweep:
        for strategy in sorted({r["strategy"] for r in sweep}):
            points = sorted((r["rate"], r["output_tokens_per_s"]) for r in sweep if r["strategy"] == strategy)
            axes[2].plot(*zip(*points), marker="o", label=strategy)
        axes[2].set_xlabel("arrival rate (requests/s)")
        axes[2].set_title("output tokens/s vs arrival rate")
        axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: Gemma 3 270M)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=math.inf, help="Poisson arrival rate in requests/s (inf: all at once)")
    p.add_argument("--sweep-rates", default=None, help="comma-separated rates: also plot throughput vs rate")
    p.add_argument("--input-len", type=parse_range, default=(32, 256), help="MIN:MAX prompt tokens")
    p.add_argument("--output-len", type=parse_range, default=(128, 128), help="MIN:MAX output tokens")
    p.add_argument("--strategies", default="none,static,dynamic,continuous,paged")
    p.add_argument("--peer", default="", help="comma-separated baselines: hf, llamacpp")
    p.add_argument("--max-slots", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-cache-mb", type=int, default=1024, help="one KV budget for every strategy")
    p.add_argument("--batch-size", type=int, default=16, help="dynamic batch size, static payload and HF batch")
    p.add_argument("--max-batch-delay-ms", type=float, default=50.0)
    p.add_argument("--long-prompts", type=parse_range, default=None, metavar="COUNT:LEN",
                   help="COUNT prompts of LEN tokens, sent once every other request is decoding")
    p.add_argument("--dtype", default=EngineConfig.dtype, help="weights (auto: bfloat16)")
    p.add_argument("--kv-cache-dtype", default=EngineConfig.kv_cache_dtype)
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                   help="token budget of a step")
    p.add_argument("--decode-steps", default="1", help="comma-separated: an engine for each decode_steps")
    p.add_argument("--quantizations", default="none", help="comma-separated: an engine for each of none, int8, "
                                                           "w8a8, auto")
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="also run every strategy on an engine that prefills prompts whole")
    p.add_argument("--no-prefix-caching", action="store_true", help="also run every strategy with the prefix cache off")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="also run every strategy with each step's tokens collected before the next is scheduled")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="tokens every prompt starts with")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="run every engine and peer this many times, in turn, "
                   "and print each one's median and its per-round ratios to the first row")
    p.add_argument("--trace", default=None, metavar="DIR", help="a jax.profiler trace of each run in DIR, and the "
                   "device's busy share read from it")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--timeline", default=None, metavar="PNG", help="slot timelines of every run, one panel each")
    return p


def _print_rounds(rows: list[dict]) -> None:
    """Each run's median throughput over the rounds, and its ratios to the first row's and to each
    peer's run of the same round (the median and the range): the runs of one round ran minutes
    apart, the rounds further, and this machine's speed drifts between them."""
    runs: dict[str, dict[int, float]] = {}
    for row in rows:
        runs.setdefault(row["strategy"].rsplit(" #", 1)[0], {})[row["round"]] = row["output_tokens_per_s"]
    names = list(runs)
    print(f"\nover {len(runs[names[0]])} rounds: out tok/s, median; ratios to each run of the same round, "
          "median (min-max)")
    for name in names:
        against = [other for other in names[:1] + [n for n in names if n.startswith("peer:")] if other != name]
        ratios = {other: [runs[name][r] / runs[other][r] for r in runs[name] if r in runs[other]] for other in against}
        print(f"  {name}: {np.median(list(runs[name].values())):.1f}" + "".join(
            f"; {np.median(v):.2f}x {other} ({min(v):.2f}-{max(v):.2f})" for other, v in ratios.items() if v))


def _print_summary(rows: list[dict], args, compile_s: float) -> None:
    rate = "all at once" if math.isinf(args.rate) else f"Poisson {args.rate}/s"
    print(f"\n{args.num_requests} requests ({rate}), input {args.input_len[0]}-{args.input_len[1]}, output "
          f"{args.output_len[0]}-{args.output_len[1]} tokens, max_slots {args.max_slots}, KV budget "
          f"{args.kv_cache_mb} MiB, compile {compile_s:.0f} s (not timed)\n")
    print_table(rows)
    if args.rounds > 1:
        _print_rounds(rows)
    for suffix in ("", " (no chunked prefill)"):
        base = next((r for r in rows if r["strategy"] == "none" + suffix), None)
        if base:
            print(f"\nvs none{suffix}: " + ", ".join(
                f"{r['strategy']} {r['output_tokens_per_s'] / base['output_tokens_per_s']:.1f}x"
                for r in rows if r is not base and r["strategy"].endswith(suffix) and "peer" not in r["strategy"]))


def _runs(engine: Engine, work: Workload, args, timelines, round_: int | None = None) -> list[dict]:
    """The rows of one engine's runs: each strategy, and the variants asked for."""
    rows = []
    for s in filter(None, args.strategies.split(",")):
        rows.append(run_strategy(engine, s, work, args, timelines=timelines))
        if args.no_prefix_caching or args.shared_prefix_len:
            rows.append(run_strategy(engine, s, work, args, caching=False, timelines=timelines))
        if args.no_async_scheduling:
            rows.append(run_strategy(engine, s, work, args, overlap=False, timelines=timelines))
    return [_numbered(row, round_) for row in rows]


def _numbered(row: dict, round_: int | None) -> dict:
    return row if round_ is None else {**row, "strategy": f"{row['strategy']} #{round_ + 1}", "round": round_}


def main(argv=None) -> tuple[list[dict], list | None]:
    args = _parser().parse_args(argv)
    keep_freed_memory()  # as `jaxserve serve`'s engine process does

    config = EngineConfig(max_slots=args.max_slots, max_model_len=args.max_model_len,
                          kv_cache_bytes=args.kv_cache_mb << 20, max_num_batched_tokens=args.max_num_batched_tokens,
                          dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    engines = [config.replace(decode_steps=int(k), quantization=quantization_arg(q))
               for q in args.quantizations.split(",") for k in args.decode_steps.split(",")]
    engines += [config.replace(enable_chunked_prefill=False)] if args.no_chunked_prefill else []
    rows, compile_s, built = [], 0.0, []
    timelines = [] if args.timeline else None
    for config in engines:
        t0 = time.monotonic()
        engine = Engine.from_pretrained(args.model, config)
        load_s = time.monotonic() - t0
        t0 = time.monotonic()
        engine.runner.warmup()
        compile_s += time.monotonic() - t0
        print(f"model {engine.model_name}: loaded in {load_s:.1f} s; {engine.stats()['num_compiles']} shapes "
              f"compiled in {time.monotonic() - t0:.1f} s; KV pool {engine.stats()['total_pages']} pages of "
              f"{engine.config.page_size} tokens; chunked prefill {config.enable_chunked_prefill}", file=sys.stderr)
        work = make_workload(args, engine.model_config.vocab_size)
        if args.rounds > 1:  # run below, in turn with the others
            built.append(engine)
        else:
            rows += _runs(engine, work, args, timelines)
    peers = [p for p in args.peer.split(",") if p]
    for round_ in range(args.rounds):  # engines and peers alternate, so that a slower spell of the machine hits all
        for engine in built:
            rows += _runs(engine, work, args, timelines, round_)
        for peer in peers:
            rows.append(_numbered({"hf": run_hf_peer, "llamacpp": run_llamacpp_peer}[peer](args.model, work, args),
                                  round_ if args.rounds > 1 else None))
    sweep = []
    for rate in [float(r) for r in args.sweep_rates.split(",")] if args.sweep_rates else []:
        swept = make_workload(argparse.Namespace(**{**vars(args), "rate": rate}), engine.model_config.vocab_size)
        for s in args.strategies.split(","):
            sweep.append({"rate": rate, **run_strategy(engine, s, swept, args)})
    _print_summary(rows, args, compile_s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: (v if not isinstance(v, float) or math.isfinite(v) else "inf")
                                for k, v in vars(args).items()},
                       "load_s": load_s, "compile_s": compile_s, "results": rows, "sweep": sweep}, f, indent=2)
    if args.plot:
        plot(rows, sweep, args.plot)
    if args.timeline:
        plot_timelines(timelines, args.timeline)
    return rows, timelines


if __name__ == "__main__":
    main()
