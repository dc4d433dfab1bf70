"""Engine behaviour on a tiny Llama: parity with Hugging Face `generate`, batch invariance,
preemption, no leaked pages, no recompiles, streaming, abort, stop strings and bad input."""

import dataclasses
import os

import numpy as np
import pytest
import torch
import transformers

from jaxserve import Engine, EngineConfig, SamplingParams
from jaxserve.faults import faults

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT_LENGTHS = [1, 5, 7, 8, 9, 16, 17, 30]  # around the 8-token page boundaries


def prompts(n=len(PROMPT_LENGTHS), seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, 150, size=PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def engine(llama_dir):
    return Engine.from_pretrained(llama_dir, EngineConfig(max_slots=16, page_size=8, num_pages=128, max_model_len=128,
                                                          dtype="float32"))


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32).eval()


def assert_idle(engine):
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["used_pages"] == 0 and stats["free_pages"] + stats["cached_pages"] == stats["total_pages"], \
        "KV pages leaked"


@pytest.fixture
def fault():
    """`faults.arm(point, request_id)`, disarmed after the test."""
    yield faults.arm
    faults.clear()


def run_all(engine, requests: dict[str, list[int]]) -> dict:
    """Runs the queued `requests` (id -> prompt) to the end; their outputs by id, released."""
    engine.run_until(lambda: all(engine.request(i).finished for i in requests))
    outputs = {i: engine.output(i) for i in requests}
    for i in requests:
        engine.release(i)
    return outputs


def assert_fault_free_tokens(engine, outputs: dict, prompts: dict) -> None:
    """The outputs that did not end with `error` hold a fresh engine's tokens for their prompts."""
    rest = [i for i, o in outputs.items() if o.finish_reason != "error"]
    reference = engine.with_strategy("paged").generate([prompts[i] for i in rest], GREEDY)
    assert [outputs[i].token_ids for i in rest] == [o.token_ids for o in reference]
    assert [outputs[i].finish_reason for i in rest] == [o.finish_reason for o in reference]


def test_greedy_matches_hugging_face_generate(engine, hf_model):
    outputs = engine.generate(prompts(), GREEDY)
    for prompt, out in zip(prompts(), outputs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()
        assert out.finish_reason == "length" and out.num_prompt_tokens == len(prompt)
        assert out.ttft_s > 0 and out.latency_s >= out.ttft_s
    assert_idle(engine)


def test_batch_invariance_greedy_and_seeded(engine):
    batch = prompts(16, seed=1)
    together = engine.generate(batch, GREEDY)
    alone = [engine.generate([p], GREEDY)[0] for p in batch[:6]]
    assert [o.token_ids for o in together[:6]] == [o.token_ids for o in alone]
    sampled = SamplingParams(max_tokens=10, temperature=0.9, top_k=20, top_p=0.9, seed=1234, ignore_eos=True)
    in_batch = engine.generate(batch[:7] + [batch[0]], [GREEDY] * 7 + [sampled])[-1]
    by_itself = engine.generate([batch[0]], sampled)[0]
    assert in_batch.token_ids == by_itself.token_ids
    other_seed = engine.generate([batch[0]], SamplingParams(max_tokens=10, temperature=0.9, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != by_itself.token_ids
    assert_idle(engine)


def test_repeating_a_workload_adds_no_compiles(engine):
    engine.generate(prompts(), GREEDY)
    before = engine.stats()["num_compiles"]
    engine.generate(prompts(), GREEDY)
    assert engine.stats()["num_compiles"] == before
    assert_idle(engine)


def test_preemption_finishes_everything_with_same_tokens(llama_dir, engine):
    work = prompts(8, seed=2)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = engine.generate(work, params)
    # The workload needs about 8 x 8 pages; give it a quarter of that.
    small = Engine.from_pretrained(llama_dir, EngineConfig(max_slots=8, page_size=8, num_pages=17, max_model_len=128,
                                                            dtype="float32"))
    got = small.generate(work, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert all(o.finish_reason == "length" for o in got)
    assert small.stats()["num_preemptions"] > 0
    assert_idle(small)


def test_stream_yields_growing_text_and_finishes(engine):
    parts = list(engine.stream("the quick brown fox", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))
    assert [len(p.token_ids) for p in parts] == list(range(1, 7))
    assert parts[-1].finish_reason == "length"
    full = engine.generate("the quick brown fox", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert parts[-1].text == full.text and parts[-1].token_ids == full.token_ids
    assert_idle(engine)


def test_abort_frees_pages(engine):
    rid = engine.add_request(prompts(1)[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats()["running"] == 1
    engine.abort(rid)
    assert engine.output(rid).finish_reason == "abort"
    engine.release(rid)
    assert_idle(engine)


def test_eos_and_stop_token_ids_and_stop_strings(engine):
    base = engine.generate("the quick", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    stop_token = base.token_ids[3]
    first = base.token_ids.index(stop_token)
    out = engine.generate("the quick", SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop_token,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: first + 1]
    if base.text.strip():
        stop = base.text.strip()[-2:]
        out = engine.generate("the quick", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=(stop,)))[0]
        assert out.finish_reason == "stop" and stop not in out.text
        assert base.text.startswith(out.text)
    assert_idle(engine)


def test_a_request_whose_scheduling_raises_ends_alone_with_error(engine, fault):
    """Faults in schedule(): one request's admission raises, another's page growth raises mid-way.
    Each ends with `error`; the others get a fault-free run's tokens; no page leaks."""
    small = engine.with_strategy("paged")
    work = {f"r{i}": q for i, q in enumerate(prompts(6))}
    work |= {"bad-admission": [9, 9, 9], "bad-growth": [8] * 8}  # the second fills its page in one step
    fault("schedule", "bad-admission")
    for i, q in work.items():
        small.add_request(q, GREEDY, request_id=i)
    small.step()
    fault("schedule", "bad-growth")  # its next token needs a new page
    out = run_all(small, work)
    assert [out[i].finish_reason for i in ("bad-admission", "bad-growth")] == ["error", "error"]
    assert len(out["bad-admission"].token_ids) == 0 and len(out["bad-growth"].token_ids) == 1
    assert sum(o.finish_reason == "error" for o in out.values()) == 2
    assert_fault_free_tokens(engine, out, work)
    assert small.stats()["num_errors"] == 0  # no step failed: only those two requests
    assert_idle(small)


def test_a_request_whose_stop_string_pass_fails_ends_alone_with_error(engine, fault):
    """Its pass for stop strings raises: that request ends with `error`, the one beside it gets
    the tokens it gets alone, and no page leaks."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=("never in this text",))
    alone = engine.generate([[5, 6, 7]], params)[0].token_ids
    fault("stop_strings", "bad")
    engine.add_request([9, 9, 9], params, request_id="bad")
    engine.add_request([5, 6, 7], params, request_id="good")
    out = run_all(engine, {"bad": [9, 9, 9], "good": [5, 6, 7]})
    assert out["bad"].finish_reason == "error" and len(out["bad"].token_ids) == 1  # its first token's pass
    assert out["good"].finish_reason == "length" and out["good"].token_ids == alone
    assert_idle(engine)


def test_a_request_whose_text_fails_ends_alone_with_error(engine, fault):
    """Detokenizing a RequestOutput raises: a finished request is marked `error` (its text empty),
    a running one ends at once; the others keep their tokens and text."""
    small = engine.with_strategy("paged")
    work = {f"r{i}": q for i, q in enumerate(prompts(4))}
    reference = small.generate(list(work.values()), GREEDY)
    fault("detokenize", "r1")
    fault("detokenize", "running")
    for i, q in work.items():
        small.add_request(q, GREEDY, request_id=i)
    out = run_all(small, work)
    assert out["r1"].finish_reason == "error" and out["r1"].text == ""
    assert [(o.token_ids, o.text, o.finish_reason) for i, o in out.items() if i != "r1"] == \
        [(o.token_ids, o.text, o.finish_reason) for o in reference[:1] + reference[2:]]
    small.add_request([5, 6, 7], GREEDY, request_id="running")
    small.step()
    assert small.output("running").finish_reason == "error" and small.request("running").finished
    small.release("running")
    assert_idle(small)


@pytest.mark.parametrize("overlapped", [False, True], ids=["in_order", "async"])
def test_a_step_that_fails_on_the_device_ends_its_requests_alone(engine, fault, overlapped):
    """The first step that runs `bad` fails where its tokens are collected, the pool not consumed:
    the requests of the steps not yet collected (that one, and with async scheduling the one
    after it) end with `error`; those admitted beside it that had not run, and those queued
    later, finish with a fault-free run's tokens; no page leaks, and the engine serves on."""
    small = engine.with_strategy("paged", max_num_batched_tokens=16, async_scheduling=overlapped)
    work = {"bad": list(range(3, 23))}  # 20 tokens: its first chunk takes the whole first step
    work |= {f"r{i}": q for i, q in enumerate(prompts(8, seed=1)[1:])}  # 5 to 30 tokens: chunks after bad's
    fault("device_step", "bad")
    for i, q in work.items():
        small.add_request(q, GREEDY, request_id=i)
    out = run_all(small, work)
    errors = {i for i, o in out.items() if o.finish_reason == "error"}
    # In order: bad alone. Async: the second step (bad's last 4 tokens, 12 of r0's and r1's) too.
    assert errors == ({"bad", "r0", "r1"} if overlapped else {"bad"}) and small.stats()["num_errors"] == 1
    assert_fault_free_tokens(engine, out, work)
    assert_idle(small)
    later = {"later": list(range(3, 23))}
    small.add_request(later["later"], GREEDY, request_id="later")
    assert_fault_free_tokens(engine, run_all(small, later), later)


def test_a_page_recorded_after_its_step_was_dispatched_is_forgotten_when_that_step_fails(engine, fault):
    """Async scheduling: the decode that fills page 1 runs its token while that token is still on
    the device, so the page is recorded when the token reaches the host, with that decode in
    flight. The decode fails: the page's hash goes with it, and a prompt over it hits page 0 only."""
    small = engine.with_strategy("paged", async_scheduling=True)
    prompt = list(range(3, 18))  # 15 tokens: the first decode computes token 16, the end of page 1
    small.add_request(prompt, GREEDY, request_id="r")
    small.step()  # the prefill
    small.step()  # the decode dispatched, then the prefill's token collected: page 1 recorded
    assert small.stats()["num_errors"] == 0 and len(small.request("r").output_token_ids) == 1
    fault("device_step", "r")  # the decode fails where its token is collected
    small.step()
    first = small.request("r").output_token_ids[0]
    out = run_all(small, {"r": prompt})
    assert out["r"].finish_reason == "error"
    later = {"later": prompt + [first, 99]}
    small.add_request(later["later"], GREEDY, request_id="later")
    small.step()
    assert small.request("later").num_cached_tokens == 8  # page 0 (its prefill's step succeeded), not page 1
    assert_fault_free_tokens(engine, run_all(small, later), later)
    assert_idle(small)


def test_recover_replaces_state_a_failed_step_left_in_error(own_pool_engine):
    """A step that fails on the device hands its error to its outputs, which are not deleted:
    the pool it left in error is replaced, as a consumed one is."""
    class Failed:
        def is_deleted(self):
            return False

        def block_until_ready(self):
            raise RuntimeError("the step that made this array failed on the device")
    runner = own_pool_engine.runner
    assert not runner.recover()  # nothing lost: nothing replaced
    runner.kv_pool = (runner.kv_pool[0], Failed())
    assert runner.recover() and not any(isinstance(x, Failed) for x in runner.kv_pool)
    runner.slot_tokens = Failed()
    assert not runner.recover() and not isinstance(runner.slot_tokens, Failed)


@pytest.mark.parametrize("prompt, params, match", [
    ("", SamplingParams(), "prompt must not be empty"),
    ([], SamplingParams(), "not be empty"),
    ([5, 999], SamplingParams(), r"token ids must be in \[0, 160\)"),
    (list(range(3, 131)), SamplingParams(max_tokens=1), "max_model_len"),
    ([5] * 100, SamplingParams(max_tokens=29), "plus max_tokens"),
])
def test_bad_prompts_raise_value_error(engine, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        engine.generate([prompt] if not isinstance(prompt, str) else prompt, params)
    assert_idle(engine)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"), (dict(top_k=2**31), "top_k"), (dict(min_p=2), "min_p"), (dict(seed=-3), "seed"),
])
def test_bad_sampling_params_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(strategy="turbo"), "strategy"), (dict(dtype="float16"), "dtype"), (dict(max_slots=0), "max_slots"),
    (dict(num_pages=1), "num_pages"), (dict(attention_backend="cuda"), "attention_backend"),
    (dict(max_num_batched_tokens=16, max_slots=32), "max_num_batched_tokens"),
    (dict(enable_chunked_prefill=1), "enable_chunked_prefill"),
])
def test_bad_engine_config_raises_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_the_configurable_backends_are_auto_and_the_kernels_implementations():
    from jaxserve.config import BACKENDS
    from jaxserve.pallas_kernels import IMPLEMENTATIONS, select_backend
    assert BACKENDS == ("auto", *IMPLEMENTATIONS)
    assert select_backend("auto") == "reference"  # on CPU
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        select_backend("cuda")


def test_engine_keeps_serving_after_bad_input(engine):
    with pytest.raises(ValueError):
        engine.generate(["fine prompt", ""], GREEDY)
    assert_idle(engine)  # nothing of the rejected payload was queued
    assert engine.generate("fine prompt", GREEDY)[0].finish_reason == "length"


def test_a_max_model_len_the_pool_cannot_hold_is_refused(llama_dir):
    config = EngineConfig(max_slots=8, page_size=8, num_pages=16, max_model_len=128)
    message = (r"max_model_len 128 does not fit the KV pool: one sequence of 128 tokens needs 16 pages, the pool "
               r"has 15, which hold at most 120 tokens")
    for strategy in ("continuous", "paged"):
        with pytest.raises(ValueError, match=message):
            Engine.from_pretrained(llama_dir, config.replace(strategy=strategy))
    paged = Engine.from_pretrained(llama_dir, config.replace(max_model_len=120))
    assert paged.with_strategy("continuous").max_model_len == 120
    with pytest.raises(ValueError, match="with_strategy changes scheduling only: max_slots, page_size need a new"):
        paged.with_strategy("paged", page_size=16, max_slots=4, batch_size=2)
    other = paged.with_strategy("dynamic", batch_size=2)
    assert other.runner is paged.runner and other.config.batch_size == 2 and other.tokenizer is paged.tokenizer


def test_max_model_len_counts_what_sliding_windows_free(checkpoints):
    path = checkpoints("gemma3")  # context 512, window 8: one full group and two sliding ones
    config = EngineConfig(max_slots=4, page_size=8, max_num_batched_tokens=64, dtype="float32")
    # 512 tokens: 64 pages in the full group, 10 in each sliding one (window, a step, an edge page).
    assert Engine.from_pretrained(path, config.replace(num_pages=85)).max_model_len == 512
    assert Engine.from_pretrained(path, config.replace(num_pages=60)).max_model_len == 312  # 39 + 10 + 10
    message = (r"max_model_len 512 does not fit the KV pool: one sequence of 512 tokens needs 84 pages, the pool "
               r"has 59, which hold at most 312 tokens")
    with pytest.raises(ValueError, match=message):
        Engine.from_pretrained(path, config.replace(num_pages=60, max_model_len=512))


def test_missing_model_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        Engine.from_pretrained(str(tmp_path / "nope"))


def test_pallas_backend_in_interpret_mode_gives_the_same_tokens(checkpoints):
    """Gemma 3 only (sliding window, QK-norm, GQA): the kernel tests cover the plainer models'
    attention; this checks the kernel wired into the engine's step."""
    kind = "gemma3"
    config = EngineConfig(max_slots=4, page_size=8, num_pages=32, max_model_len=64, dtype="float32")
    work = prompts(4, seed=3)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)  # gemma3's window is 8: crossed
    reference = Engine.from_pretrained(checkpoints(kind), config.replace(attention_backend="reference"))
    pallas = Engine.from_pretrained(checkpoints(kind), config.replace(attention_backend="pallas"))
    assert pallas.backend == "pallas"
    expected = [o.token_ids for o in reference.generate(work, params)]
    assert [o.token_ids for o in pallas.generate(work, params)] == expected
    assert_idle(pallas)


def test_greedy_tokens_are_identical_under_every_strategy(engine):
    work = prompts(10, seed=4)
    params = [SamplingParams(max_tokens=5 + i % 4, temperature=0, ignore_eos=True) for i in range(10)]
    expected = [o.token_ids for o in engine.generate(work, params)]
    for strategy in ("none", "static", "dynamic", "continuous", "paged"):
        other = engine.with_strategy(strategy, batch_size=3, max_batch_delay_ms=0.0)
        assert [o.token_ids for o in other.generate(work, params)] == expected, strategy
        assert_idle(other)


def test_an_engine_serves_no_prefix_from_pages_another_over_its_runner_wrote(engine):
    """Engines from with_strategy share the KV pool, each with its own prefix cache: once the other
    has run steps, this one's cached pages may hold the other's K/V, so it forgets them."""
    first, other = [list(range(3, 40))], [list(range(50, 90))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = engine.generate(first, params)[0].token_ids
    assert engine.generate(first, params)[0].num_cached_tokens == 32  # its own pages serve it
    engine.with_strategy("continuous").generate(other, params)
    again = engine.generate(first, params)[0]
    assert again.token_ids == expected and again.num_cached_tokens == 0
    assert_idle(engine)


def test_bfloat16_engine_runs_and_stays_close_to_float32(llama_dir, engine):
    bf16 = Engine.from_pretrained(llama_dir, EngineConfig(max_slots=4, page_size=8, num_pages=64, max_model_len=128,
                                                          dtype="bfloat16"))
    work = prompts(4, seed=5)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got, expected = bf16.generate(work, params), engine.generate(work, params)
    assert all(len(o.token_ids) == 6 and o.finish_reason == "length" for o in got)
    # bfloat16 keeps 8 mantissa bits: the first greedy token of a random tiny model mostly survives.
    assert sum(g.token_ids[0] == e.token_ids[0] for g, e in zip(got, expected)) >= 3
    assert_idle(bf16)


def test_a_failing_step_ends_its_requests_with_error_and_the_engine_goes_on(engine, monkeypatch):
    small = engine.with_strategy("paged", max_num_batched_tokens=16)
    first = small.add_request(prompts(1)[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    small.step()  # prefill
    second = small.add_request(list(range(3, 43)), SamplingParams(max_tokens=5))  # 40 tokens: 3 chunks
    small.step()
    assert small.request(second).num_computed_tokens == 15  # in the middle of its prefill
    real_dispatch = small.runner.dispatch

    def broken(*args, **kwargs):
        monkeypatch.setattr(small.runner, "dispatch", real_dispatch)  # fail once
        raise RuntimeError("device fell over")
    monkeypatch.setattr(small.runner, "dispatch", broken)
    finished = small.step()
    assert [r.request_id for r in finished] == [first, second]
    assert [small.output(i).finish_reason for i in (first, second)] == ["error", "error"]
    small.release(first)
    small.release(second)
    assert_idle(small)
    assert small.generate("the quick", GREEDY)[0].finish_reason == "length"


def test_a_step_that_consumed_the_kv_pool_leaves_no_stale_kv_behind(llama_dir, engine, monkeypatch):
    own = Engine.from_pretrained(llama_dir, engine.config)  # its own pool: the module's stays whole
    small = own.with_strategy("paged", max_num_batched_tokens=16)
    prefix = list(range(3, 19))  # two full pages
    small.generate([prefix + [100, 101, 102]], GREEDY)  # leaves them in the prefix cache
    failing = small.add_request(list(range(40, 80)), GREEDY)  # its first chunk takes the whole budget
    bystander = small.add_request(prefix + [110, 111, 112], GREEDY)  # admitted on the cached pages, runs nothing
    runner, real_executable, donated = small.runner, small.runner.programs.get, []

    def forward_fails_after_consuming_the_pool(key):
        program = real_executable(key)
        if key[0] != "forward":
            return program
        monkeypatch.setattr(runner.programs, "get", real_executable)  # fail once

        def run(state, pool, *args):
            program(state, pool, *args)
            donated.append(all(x.is_deleted() for x in pool))
            raise RuntimeError("device fell over after the pool was donated")
        return run
    monkeypatch.setattr(runner.programs, "get", forward_fails_after_consuming_the_pool)
    assert [r.request_id for r in small.step()] == [failing]
    assert donated == [True] and small.output(failing).finish_reason == "error"
    assert small.request(bystander).num_cached_tokens == 16  # it did count on the old pool
    later = small.add_request(prefix + [120, 121, 122], GREEDY)  # would hit the old cache
    small.run_until(lambda: small.request(bystander).finished and small.request(later).finished)
    reference = engine.with_strategy("paged").generate([prefix + [110, 111, 112], prefix + [120, 121, 122]], GREEDY)
    assert [small.output(i).token_ids for i in (bystander, later)] == [o.token_ids for o in reference]
    assert [small.output(i).finish_reason for i in (bystander, later)] == ["length", "length"]
    for i in (failing, bystander, later):
        small.release(i)
    assert_idle(small)


def test_a_step_that_failed_on_the_device_leaves_no_page_of_its_in_the_prefix_cache(llama_dir, engine, monkeypatch):
    """The step fails where its tokens are collected, the pool untouched (a device error): the
    prompt pages it filled were put in the prefix cache at dispatch, and their K/V may never have
    been written, so they are forgotten; a later request with that prompt computes it again."""
    own = Engine.from_pretrained(llama_dir, engine.config)
    small = own.with_strategy("paged", max_num_batched_tokens=16)
    prefix = list(range(3, 19))  # two full pages: the failing step's one chunk
    failing = small.add_request(prefix + [100, 101], GREEDY)
    real = small.runner.collect

    def collect_fails_once(step):
        monkeypatch.setattr(small.runner, "collect", real)
        raise RuntimeError("the device reported an error for this step")
    monkeypatch.setattr(small.runner, "collect", collect_fails_once)
    assert [r.request_id for r in small.step()] == [failing]
    assert not any(x.is_deleted() for x in small.runner.kv_pool)  # the pool survived
    assert small.stats()["cached_pages"] == 0
    later = small.add_request(prefix + [120, 121], GREEDY)
    small.run_until(lambda: small.request(later).finished)
    assert small.request(later).num_cached_tokens == 0
    assert small.output(later).token_ids == engine.with_strategy("paged").generate([prefix + [120, 121]], GREEDY)[0].token_ids
    for i in (failing, later):
        small.release(i)
    assert_idle(small)


FAULT_REPS = int(os.environ.get("JAXSERVE_FAULT_REPS", "3"))  # issue 26's target runs it 100 times


@pytest.fixture(scope="module")
def own_pool_engine(llama_dir, engine):
    return Engine.from_pretrained(llama_dir, engine.config)  # its own pool: the module's stays whole


@pytest.mark.parametrize("seed", range(FAULT_REPS))
def test_no_stale_kv_after_a_failure_at_a_random_point(own_pool_engine, engine, monkeypatch, seed):
    """Cached prefixes, then a random mix of requests, some on them; the forward that consumes the
    pool fails at a random step. The requests of that step end with `error`; every other one, and
    every one queued after, gets a fresh engine's greedy tokens."""
    rng = np.random.default_rng(seed)
    small = own_pool_engine.with_strategy("paged", max_num_batched_tokens=16)
    prefixes = [rng.integers(3, 150, 8 * int(rng.integers(1, 4))).tolist() for _ in range(3)]
    small.generate([p + [100] for p in prefixes], GREEDY)  # leaves them in the prefix cache

    def prompt() -> list[int]:
        shared = prefixes[int(rng.integers(3))] if rng.random() < 0.7 else []
        return shared + rng.integers(3, 150, int(rng.integers(1, 12))).tolist()
    work = {small.add_request(q, GREEDY): q for q in (prompt() for _ in range(int(rng.integers(2, 7))))}
    runner, real_executable, calls, failed = small.runner, small.runner.programs.get, [], []
    fail_at = int(rng.integers(0, 10))  # every mix runs at least 12 forward steps

    def executable(key):
        program = real_executable(key)
        if key[0] != "forward" or failed:
            return program

        def run(state, pool, *args):
            calls.append(key)
            result = program(state, pool, *args)
            if len(calls) > fail_at:
                failed.append(all(x.is_deleted() for x in pool))
                raise RuntimeError("device fell over after the pool was donated")
            return result
        return run
    monkeypatch.setattr(runner.programs, "get", executable)
    errors = None
    while small.has_unfinished():
        finished = small.step()
        if failed and errors is None:
            errors = {r.request_id for r in finished}
            work |= {small.add_request(q, GREEDY): q for q in (prompt() for _ in range(3))}  # on the old cache
    assert failed == [True] and errors  # it failed once, after the donation, and ended its step's requests
    ends = {i: small.output(i) for i in work}
    assert {i for i, o in ends.items() if o.finish_reason == "error"} == errors
    rest = [i for i in work if i not in errors]
    reference = engine.with_strategy("paged").generate([work[i] for i in rest], GREEDY)
    assert [ends[i].token_ids for i in rest] == [o.token_ids for o in reference]
    for i in work:
        small.release(i)
    assert_idle(small)


def test_async_scheduling_gives_the_outputs_of_steps_run_in_order(engine):
    overlapped = engine.with_strategy("paged", async_scheduling=True)
    in_order = engine.with_strategy("paged", async_scheduling=False)
    work = prompts(8, seed=6)
    base = in_order.generate(work, GREEDY)
    stop = base[0].token_ids[4]  # ends request 0 (and any other that meets it) on a stop token
    params = [SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop,)),
              SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0, logprobs=2, ignore_eos=True)] * 3
    expected = in_order.generate(work, params[:8])
    got = overlapped.generate(work, params[:8])
    assert overlapped.config.overlaps_steps and not in_order.config.overlaps_steps
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in expected]
    for o, e in zip(got, expected):  # the same up to float rounding: steps may batch differently
        assert (o.logprobs is None) == (e.logprobs is None)
        for a, b in zip(o.logprobs or [], e.logprobs or []):
            assert [t for t, _ in a["top"]] == [t for t, _ in b["top"]]
            np.testing.assert_allclose([a["logprob"]] + [lp for _, lp in a["top"]],
                                       [b["logprob"]] + [lp for _, lp in b["top"]], atol=1e-5)
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == stop
    assert_idle(engine)


def test_describe_says_what_start_up_resolved(llama_dir):
    from jaxserve.model.loader import load_model
    cfg, weights, tokenizer, _ = load_model(llama_dir)
    long = dataclasses.replace(cfg, max_position_embeddings=4096)
    config = EngineConfig(max_slots=4, page_size=8, num_pages=64, dtype="float32")
    lines = Engine(long, weights, tokenizer, config).describe().splitlines()
    assert lines[2].startswith("weights float32 (asked for)")
    assert lines[-1] == "KV-cache groups: 1 full attention; 2 layers per page"
    assert lines[3].startswith("KV pool 64 pages of 8 tokens")
    assert lines[3].endswith("(num_pages asked for); max_model_len 504 (the longest sequence the KV pool holds: "
                             "the model's context of 4096 tokens needs 512 pages, the pool has 63)")
    roomy = Engine(long, weights, tokenizer, config.replace(num_pages=513)).describe().splitlines()
    assert roomy[3].endswith("max_model_len 4096 (the model's context)")
    asked = Engine(long, weights, tokenizer, config.replace(max_model_len=256)).describe().splitlines()
    assert asked[3].endswith("max_model_len 256 (asked for)")


def test_no_step_program_branches_on_a_value_the_device_computes(engine, monkeypatch):
    """On accelerators a conditional's predicate is copied to the host and waited for, so the step
    programs there hold none: the host picks each batch's sampling program, and what is left inside
    one is a select. (On the CPU, where a conditional costs nothing, the sampler keeps them.)"""
    from jaxserve.worker import sampling
    monkeypatch.setattr(sampling, "conditionals_skip_work", lambda: False)
    runner = engine.runner
    keys = runner.all_programs()
    assert {k[2] for k in keys if k[0] == "sample"} == {"greedy", "random", "cuts"}
    for key in keys:
        jitted, args = runner.program(key)
        text = jitted.lower(*args).as_text()
        assert "stablehlo.case" not in text and "stablehlo.if" not in text, key
    monkeypatch.setattr(sampling, "conditionals_skip_work", lambda: True)
    jitted, args = runner.program(("sample", runner.buckets.row_sizes[0], "cuts"))
    assert "stablehlo.case" in jitted.lower(*args).as_text()  # the check can see a conditional


def _host_bytes(obj) -> int:
    """Bytes of every host array in a step's inputs (nested dataclasses walked)."""
    if dataclasses.is_dataclass(obj):
        return sum(_host_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return obj.nbytes if isinstance(obj, np.ndarray) else 0


def test_a_decode_step_copies_one_host_array_to_the_device(engine, monkeypatch):
    """Once every request decodes, a step's programs take one host array between them (its inputs
    and block-table entries packed together); what else they read is on the device already, the
    weights as a flat tuple of arrays (an nnx.State would be flattened in Python on every call)."""
    import jax
    small = engine.with_strategy("paged")
    ids = [small.add_request(p, SamplingParams(max_tokens=60, temperature=0.8, seed=1, ignore_eos=True))
           for p in prompts(4)]
    while small.scheduler.waiting or any(r.num_uncomputed_tokens > 1 for r in small.scheduler.running):
        small.step()
    real, host_arrays, weights = small.runner.programs.get, [], []

    def counting(key):
        program = real(key)

        def run(*args):
            host_arrays.append(sum(isinstance(x, np.ndarray) for x in jax.tree.leaves(args)))
            weights.append(args[0])
            return program(*args)
        return run
    monkeypatch.setattr(small.runner.programs, "get", counting)
    for _ in range(12):  # 12 tokens: every sequence crosses a page (8 tokens) at least once
        small.step()
    assert len(host_arrays) == 12 * 2 and sum(host_arrays) == 12  # forward and sample; one array a step
    assert all(type(w) is tuple and all(isinstance(x, jax.Array) for x in w) for w in weights)
    for i in ids:
        small.abort(i)
        small.release(i)
    assert_idle(small)


def test_what_a_step_copies_to_the_device_does_not_grow_with_max_model_len(llama_dir, monkeypatch):
    """The same requests under a context 4x longer copy the same bytes per step: the block tables
    stay on the device, and a step brings only the entries written since the last one."""
    copied = {}
    for max_model_len in (128, 512):
        eng = Engine.from_pretrained(llama_dir, EngineConfig(max_slots=4, page_size=8, num_pages=80,
                                                             max_model_len=max_model_len, dtype="float32"))
        sizes = copied[max_model_len] = []
        real = eng.runner.dispatch
        monkeypatch.setattr(eng.runner, "dispatch", lambda batch, logprobs=False: (
            sizes.append(_host_bytes(batch)), real(batch, logprobs))[1])
        eng.generate([list(range(3, 3 + n)) for n in (5, 20, 33)], SamplingParams(max_tokens=12, temperature=0,
                                                                                  ignore_eos=True))
        assert eng.runner.block_tables.shape[-1] == max_model_len // 8
    assert copied[128] == copied[512] and len(copied[128]) > 10


def test_block_table_entries_lost_with_a_failed_step_are_sent_again(own_pool_engine, engine, monkeypatch):
    """The first step fails before its block-table entries (which go with its forward program)
    reach the device, the pool untouched: its one prompt chunk's request ends with `error`, and
    the three admitted beside it, whose entries that step carried too, still get a fresh
    engine's greedy tokens."""
    small = own_pool_engine.with_strategy("paged", max_num_batched_tokens=16)
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((30, 21, 9, 17))]
    work = {small.add_request(q, GREEDY): q for q in prompts}
    real, calls = small.runner.programs.get, []

    def executable(key):
        program = real(key)
        if key[0] != "forward":
            return program

        def run(*args):
            calls.append(key)
            if len(calls) == 1:
                raise RuntimeError("the device refused the table entries")
            return program(*args)
        return run
    monkeypatch.setattr(small.runner.programs, "get", executable)
    errors = set()
    while small.has_unfinished():
        errors |= {r.request_id for r in small.step() if r.finish_reason.value == "error"}
    assert len(errors) == 1 and len(calls) > 1
    rest = [i for i in work if i not in errors]
    reference = engine.with_strategy("paged").generate([work[i] for i in rest], GREEDY)
    assert [small.output(i).token_ids for i in rest] == [o.token_ids for o in reference]
    for i in work:
        small.release(i)
    assert_idle(small)
