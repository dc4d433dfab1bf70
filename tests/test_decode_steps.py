"""Several decode steps in one dispatch (`EngineConfig.decode_steps`): the same tokens as single
steps, greedy and seeded, across admissions, preemption, aborts, prefix hits, sliding windows and
mixed sampling; requests that stop mid-way (EOS, a stop token, max_tokens) end right there with
no page leaked; and rows the host must see token by token run single steps."""

import dataclasses

import numpy as np
import pytest

from jaxserve import Engine, EngineConfig, SamplingParams
from jaxserve.model.loader import load_model

STEPS = 4


def config(**changes) -> EngineConfig:
    return EngineConfig(**({"max_slots": 8, "page_size": 8, "num_pages": 96, "max_model_len": 128,
                            "dtype": "float32"} | changes))


@pytest.fixture(scope="module")
def single(llama_dir):
    return Engine.from_pretrained(llama_dir, config())


@pytest.fixture(scope="module")
def multi(llama_dir):
    return Engine.from_pretrained(llama_dir, config(decode_steps=STEPS))


def prompts(n, seed=0, low=3, high=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 150, int(rng.integers(low, high))).tolist() for _ in range(n)]


def assert_idle(engine):
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["used_pages"] == 0, "KV pages leaked"


def outputs(engine, work, params, **kwargs):
    out = engine.generate(work, params, **kwargs)
    assert_idle(engine)
    return [(o.token_ids, o.finish_reason) for o in out]


def multi_steps_run(engine, since: int = 0) -> int:
    """Steps of the engine's history (from `since` on) that ran several tokens per decoding sequence."""
    return sum(1 for s in list(engine.history)[since:] if s.tokens > s.decode_rows + s.prefill_tokens)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=23, temperature=0, ignore_eos=True),
    [SamplingParams(max_tokens=5 + 3 * i, temperature=0.8 * (i % 2), top_k=(0, 20)[i % 2 == 1 and i > 4],
                    top_p=(1.0, 0.9)[i % 3 == 0], seed=i, ignore_eos=True) for i in range(12)],
], ids=["greedy", "mixed seeded"])
def test_the_tokens_of_single_steps(single, multi, params):
    """12 requests over 8 slots: admissions join between multi-step dispatches, and max_tokens
    lands at every offset within one."""
    work = prompts(12)
    before = len(multi.history)
    assert outputs(multi, work, params) == outputs(single, work, params)
    assert multi_steps_run(multi, before), "no step ran several decode steps"


def test_requests_that_stop_mid_way_end_there(single, multi):
    """EOS, a stop token and max_tokens at step j < K: each ends on that token, with its reason."""
    work = prompts(8, seed=3)
    free = single.generate(work, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    cases = []
    for i, out in enumerate(free):  # a stop token at each offset of the first dispatches
        stop = out.token_ids[3 + i % STEPS]
        cases.append(SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=(stop,)))
    assert outputs(multi, work, cases) == outputs(single, work, cases)
    assert all(reason == "stop" for _, reason in outputs(multi, work, cases))
    length = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in range(2, 10)]
    assert [len(ids) for ids, _ in outputs(multi, work, length)] == list(range(2, 10))


def test_eos_ends_a_request_mid_way(llama_dir, single):
    """A model whose EOS is a token its greedy outputs hold: requests end on it, as with single steps."""
    work = prompts(8, seed=5)
    free = single.generate(work, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    eos = tuple({out.token_ids[2 + i] for i, out in enumerate(free[:3])})
    model_config, weights, tokenizer, _ = load_model(llama_dir)
    one, four = (Engine(dataclasses.replace(model_config, eos_token_ids=eos), weights, tokenizer,
                        config(decode_steps=k)) for k in (1, STEPS))
    params = SamplingParams(max_tokens=30, temperature=0)
    got = outputs(four, work, params)
    assert got == outputs(one, work, params)
    ended = [ids for ids, reason in got if reason == "stop"]
    assert len(ended) >= 3 and all(ids[-1] in eos for ids in ended)


def test_preemption_abort_and_prefix_hits(llama_dir, single):
    """A pool too small for every sequence's look-ahead: the engine preempts and recomputes, and
    a shared prefix is served from the cache; an abort mid-way frees everything."""
    small = Engine.from_pretrained(llama_dir, config(num_pages=24, decode_steps=STEPS))
    before = len(small.history)
    shared = list(range(10, 34))
    work = [shared + p for p in prompts(8, seed=4, low=1, high=12)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    reference = outputs(single, work, params)
    assert outputs(small, work, params) == reference
    assert small.stats()["num_preemptions"] > 0 and small.stats()["prefix_cache_hits"] > 0
    assert multi_steps_run(small, before)
    ids = [small.add_request(p, params) for p in work]
    for _ in range(6):
        small.step()
    for i in ids[::2]:
        small.abort(i)
    while small.has_unfinished():
        small.step()
    for i, ref in zip(ids[1::2], reference[1::2]):
        assert small.output(i).token_ids == ref[0]
    for i in ids:
        small.release(i)
    assert_idle(small)


def test_sliding_windows(checkpoints):
    """Gemma 2's local layers (8-token windows) free pages while several steps run at once."""
    path = checkpoints("gemma2")
    one, four = (Engine.from_pretrained(path, config(decode_steps=k)) for k in (1, STEPS))
    work, params = prompts(6, seed=6), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    assert outputs(four, work, params) == outputs(one, work, params)
    assert multi_steps_run(four)


def test_rows_the_host_checks_token_by_token_run_single_steps(single, multi):
    """Log-probabilities and stop strings need the host after every token: while such a request
    runs, every step is a single one, and the tokens are the same."""
    work = prompts(4, seed=7)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    before = len(multi.history)
    assert outputs(multi, work, params) == outputs(single, work, params)
    assert not multi_steps_run(multi, before)


def test_no_compiles_after_warmup(llama_dir):
    engine = Engine.from_pretrained(llama_dir, config(decode_steps=STEPS))
    engine.warmup()
    compiled = engine.stats()["num_compiles"]
    outputs(engine, prompts(12), SamplingParams(max_tokens=20, temperature=0.7, top_k=10, seed=1, ignore_eos=True))
    outputs(engine, prompts(3), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert engine.stats()["num_compiles"] == compiled


def test_overlapped_steps_as_on_accelerators(llama_dir, single):
    """Async scheduling (the accelerators' default): the next dispatch is scheduled while K steps
    run, counting K pending tokens per request; tokens, stops and pages as with single steps."""
    overlapped = Engine.from_pretrained(llama_dir, config(decode_steps=STEPS, async_scheduling=True))
    work = prompts(12, seed=9)
    mixed = [SamplingParams(max_tokens=3 + 2 * i, temperature=0.7 * (i % 2), seed=i, ignore_eos=i % 3 > 0)
             for i in range(12)]
    assert outputs(overlapped, work, mixed) == outputs(single, work, mixed)
    assert multi_steps_run(overlapped)


def test_the_loop_form_of_accelerators_gives_the_same_tokens(llama_dir, single, monkeypatch):
    """Accelerators run the steps in a loop of known trip count (XLA:CPU unrolls them)."""
    from jaxserve.worker import step_programs
    monkeypatch.setattr(step_programs, "unrolls_loops", lambda: False)
    looped = Engine.from_pretrained(llama_dir, config(decode_steps=STEPS))
    jitted, args = looped.runner.program(("decode", looped.runner.buckets.row_sizes[0], "greedy"))
    assert "stablehlo.while" in jitted.lower(*args).as_text()
    work, params = prompts(10, seed=8), SamplingParams(max_tokens=17, temperature=0.9, seed=3, ignore_eos=True)
    assert outputs(looped, work, params) == outputs(single, work, params)
    assert multi_steps_run(looped)
