"""Speculative decoding with n-gram drafts (jaxserve.engine.batching.speculation): the drafts and
the acceptance count against exact values; engines with speculation on give the tokens (and
logprobs) of the same engine with it off, greedy and sampled, across admissions, preemption,
aborts and prefix hits; max_tokens and stop tokens inside a draft; the counters against a replay
of the drafting; no compile after warm-up and no page left held."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from jaxserve import Engine, EngineConfig, SamplingParams
from jaxserve.config import SpeculativeConfig
from jaxserve.engine.batching.speculation import Speculator, accepted, ngram_draft
from conftest import build_checkpoint

BASE = dict(max_slots=4, page_size=8, num_pages=96, max_model_len=160, dtype="float32")
# Prompts that repeat themselves, so that drafts are found (and a tiny random model's greedy
# output, which falls into loops, accepts many), and one that does not.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10, 11, 9], list(range(20, 44)),
           [3, 4, 3, 4, 3, 4, 3], [12, 13, 14, 15, 16, 12, 13, 14]]


def test_ngram_drafts_follow_the_latest_earlier_occurrence_of_the_longest_tail():
    assert ngram_draft([1, 2, 3, 4, 1, 2, 3], 3, 1, 3) == [4, 1, 2]
    assert ngram_draft([1, 2, 9, 1, 2, 8, 1, 2], 2, 1, 2) == [8, 1]  # the latest occurrence of [1, 2]
    assert ngram_draft([7, 1, 2, 3, 5, 3], 2, 1, 3) == [5, 3]  # [5, 3], [2, 5, 3] never occurred: [3]
    assert ngram_draft([7, 1, 2, 3, 5, 3], 2, 2, 3) == []  # not with two tokens at least
    assert ngram_draft([4, 4, 4], 5, 1, 2) == [4]  # what follows, up to the end
    assert ngram_draft([1], 3, 1, 2) == []


def test_acceptance_is_the_drafts_equal_to_the_tokens_sampled_before_them():
    assert accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted([4, 5, 6], [1, 5, 6, 7]) == 0
    assert accepted([], [3]) == 0


def test_verification_leaves_the_targets_distribution_exactly_by_enumeration():
    """Every outcome of a verifying step, enumerated on a vocabulary of 5 with a random target:
    the step samples a token after the last one (p1) and after each draft (p2 given the draft),
    keeps the drafts `accepted` says, and a rejected sequence's next step samples after the token
    it kept. For any greedy draft (a draft distribution with all its mass on one token: the
    draft model's; an n-gram's) the two tokens come out as the target's joint p1(x1) p2(x2 | x1),
    to 1e-6: Leviathan et al.'s accept-with-p(d), resample-from-the-rest, for that draft."""
    rng = np.random.default_rng(0)
    vocab = 5
    p1 = rng.dirichlet(np.ones(vocab))
    p2 = rng.dirichlet(np.ones(vocab), size=vocab)  # p2[x1]: the target after x1
    for d1, d2 in [(0, 0), (2, 4), (4, 1)]:
        out = np.zeros((vocab, vocab))
        for s1 in range(vocab):  # sampled after the last token
            for s2 in range(vocab):  # sampled after draft 1, as if it were kept
                weight = p1[s1] * p2[d1][s2]  # (the token sampled after draft 2 leaves x1, x2 alone)
                if accepted([d1, d2], [s1, s2, 0]) == 0:  # the step keeps s1; the next one samples after it
                    out[s1] += weight * p2[s1]
                else:  # it keeps d1 (= s1), then s2: the token sampled after it, or draft 2 if equal
                    out[d1, s2] += weight
        np.testing.assert_allclose(out, p1[:, None] * p2, atol=1e-6)


def test_drafting_pauses_below_the_acceptance_it_needs_and_resumes():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, min_acceptance=0.5,
                                        retry_steps=3, max_batch=2))

    class R:
        prompt_token_ids, output_token_ids = [1, 2, 1], []
        params = SamplingParams()
    r = R()
    assert spec.new_step(2) and spec.drafts(r, 10) == [2, 1] and spec.drafts(r, 1) == [2]
    for _ in range(8):  # 32 drafted, 8 accepted: below half
        spec.record(r, 4, 1)
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (8, 32, 8)
    assert spec.drafts(r, 10) == []  # paused for 3 steps
    spec.new_step(1), spec.new_step(1)
    assert spec.drafts(r, 10) == []
    spec.new_step(1)
    assert spec.drafts(r, 10) == [2, 1]
    assert not spec.new_step(3)  # more running than max_batch


def test_a_bad_speculative_config_is_a_value_error():
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(speculative={"method": "ngram", "num_tokens": 3})
    with pytest.raises(ValueError, match="method must be one of"):
        EngineConfig(speculative={"method": "eagle"})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(speculative={"prompt_lookup_min": 5, "prompt_lookup_max": 2})
    from jaxserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    assert engine_config_from_args(args).speculative == SpeculativeConfig(num_speculative_tokens=5)


@pytest.fixture(scope="module")
def engines(checkpoints):
    """An engine with K drafts per (model kind, K, config changes), built when first asked for;
    K None: speculation off, over the runner (model, compiled steps, pool) of the one with K = 5
    (`with_strategy`), so that both run the same programs. Use one of a pair at a time."""
    built = {}

    def get(kind: str, k: int | None, **more):
        key = (kind, k, tuple(sorted(more.items())))
        if key not in built:
            if k is None:
                built[key] = get(kind, 5, **more).with_strategy("paged", speculative=None)
            else:
                spec = {"num_speculative_tokens": k, "prompt_lookup_min": 1, "min_acceptance": 0.0}
                built[key] = Engine.from_pretrained(checkpoints(kind), EngineConfig(**{**BASE, **more}, speculative=spec))
        return built[key]
    return get


def tokens_of(engine, prompts, params):
    return [(o.token_ids, o.finish_reason) for o in engine.generate(prompts, params)]


def assert_idle(engine):
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == stats["used_pages"] == 0


@pytest.mark.parametrize("kind, k", [("llama", 1), ("llama", 3), ("llama", 5), ("qwen3", 5), ("gemma3", 5)])
def test_speculation_changes_no_token_greedy_or_sampled(engines, kind, k):
    off, on = engines(kind, None), engines(kind, k)
    before = on.stats()["spec_decode_num_accepted_tokens"]
    prompts = PROMPTS[:4]
    for temperature in (0.0, 0.8):  # the sampler's keys are per position: a kept draft is the token drawn there
        params = [SamplingParams(max_tokens=12 + 4 * i, temperature=temperature, top_p=0.9, seed=i, ignore_eos=True)
                  for i in range(len(prompts))]
        assert tokens_of(on, prompts, params) == tokens_of(off, prompts, params), temperature
    assert on.stats()["spec_decode_num_accepted_tokens"] > before
    assert_idle(on)


def test_requests_with_a_grammar_draft_what_it_accepts_and_change_no_token(symbols_llama_dir):
    """A request with a grammar drafts only what its grammar accepts next, and each of its rows is
    sampled under the mask after the drafts before it: tokens equal to the same engine without
    speculation, greedy and sampled, with drafts kept; the grammar still ends the output (`stop`)."""
    from jaxserve import StructuredOutputs
    on = Engine.from_pretrained(symbols_llama_dir, EngineConfig(**BASE, speculative={
        "num_speculative_tokens": 3, "prompt_lookup_min": 1, "min_acceptance": 0.0}))
    off = on.with_strategy("paged", speculative=None)
    prompts = ["abab abab ab", "the fox: [1, 2, 1, 2, 1", "yes yes yes", "{\"a\": [true, true, true"]
    specs = [StructuredOutputs(regex="(ab ){2,12}c"), StructuredOutputs(json={"type": "array", "items": {
        "enum": [1, 2]}, "minItems": 2, "maxItems": 9}), StructuredOutputs(choice=["yes yes yes yes no", "no"]),
        StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "array", "items": {"type": "boolean"},
                                                                         "maxItems": 6}}, "required": ["a"]})]
    for temperature in (0.0, 0.8):
        params = [SamplingParams(max_tokens=40, temperature=temperature, seed=i, structured_outputs=spec)
                  for i, spec in enumerate(specs)]
        before = on.stats()["spec_decode_num_accepted_tokens"]
        expected = tokens_of(off, prompts, params)
        assert tokens_of(on, prompts, params) == expected, temperature
        assert on.stats()["spec_decode_num_accepted_tokens"] > before, temperature
        assert all(reason == "stop" for _, reason in expected), expected
    assert_idle(on)


def test_a_draft_model_draws_its_drafts_under_the_grammar(symbols_llama_dir):
    """A request with a grammar drafts the draft model's tokens drawn under its grammar's masks (the
    draft's own checkpoint here, so every greedy draft is the target's masked greedy token and is
    kept, exactly); the tokens of the engine without speculation, greedy and sampled."""
    from jaxserve import StructuredOutputs
    on = Engine.from_pretrained(symbols_llama_dir, EngineConfig(**BASE, speculative={
        "method": "draft_model", "model": symbols_llama_dir, "num_speculative_tokens": 3, "min_acceptance": 0.0}))
    off = on.with_strategy("paged", speculative=None)
    specs = [StructuredOutputs(regex="(ab ){2,12}c"), StructuredOutputs(json={"type": "array", "items": {
        "enum": [1, 2]}, "minItems": 2, "maxItems": 9}), StructuredOutputs(choice=["yes yes yes yes no", "no"])]
    prompts = ["abab abab ab", "the fox: [1, 2, 1, 2, 1", "yes yes yes"]
    for temperature in (0.0, 0.8):
        params = [SamplingParams(max_tokens=40, temperature=temperature, seed=i, structured_outputs=spec)
                  for i, spec in enumerate(specs)]
        before = counts(on)
        assert tokens_of(on, prompts, params) == tokens_of(off, prompts, params), temperature
        drafted_tokens, kept = (a - b for a, b in zip(counts(on), before))
        assert drafted_tokens > 0 and (kept == drafted_tokens or temperature > 0)
    assert_idle(on)


def test_preemption_aborts_and_prefix_hits_change_no_token(engines):
    small = dict(num_pages=14, max_model_len=96)  # 13 usable pages of 8 tokens: five requests of ~70 tokens preempt
    off, on = engines("llama", None, **small), engines("llama", 5, **small)
    shared = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]  # two full pages every prompt starts with
    prompts = [shared + p for p in PROMPTS]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = tokens_of(off, prompts, params)
    assert tokens_of(on, prompts, params) == expected
    stats = on.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    ids = [on.add_request(p, params) for p in prompts]
    for _ in range(6):
        on.step()
    on.abort(ids[1])
    on.run_until(lambda: all(on.request(i).finished for i in ids))
    outs = [on.output(i) for i in ids]
    assert outs[1].finish_reason == "abort"
    assert [(o.token_ids, o.finish_reason) for j, o in enumerate(outs) if j != 1] == \
        [e for j, e in enumerate(expected) if j != 1]
    for i in ids:
        on.release(i)
    assert_idle(on)


def test_max_tokens_and_stop_tokens_inside_a_draft_end_the_output_there(engines):
    off, on = engines("llama", None), engines("llama", 5)
    free = tokens_of(off, PROMPTS, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for cut in (1, 2, 5, 9, 17):
        params = SamplingParams(max_tokens=cut, temperature=0.0, ignore_eos=True)
        assert tokens_of(on, PROMPTS, params) == [(t[:cut], "length") for t, _ in free]
    for j in (3, 7, 12):  # stop at the token the first prompt's output has at j (its first occurrence ends it)
        stop = free[0][0][j]
        params = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop], ignore_eos=True)
        got = tokens_of(on, PROMPTS[:1], params)[0]
        assert got == tokens_of(off, PROMPTS[:1], params)[0]
        assert got[1] == "stop" and got[0][-1] == stop and len(got[0]) <= j + 1
    assert_idle(on)


def test_logprobs_of_kept_drafts_are_those_without_speculation(engines):
    off, on = engines("llama", None), engines("llama", 5)
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=3, ignore_eos=True)
    kept = on.stats()["spec_decode_num_accepted_tokens"]
    want, got = off.generate(PROMPTS, params), on.generate(PROMPTS, params)
    assert on.stats()["spec_decode_num_accepted_tokens"] > kept  # they drafted, and kept some
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x["logprob"] - y["logprob"]) < 1e-4
            assert [t for t, _ in x["top"]] == [t for t, _ in y["top"]]
            assert max(abs(u - v) for (_, u), (_, v) in zip(x["top"], y["top"])) < 1e-4
    assert_idle(on)


def test_a_stop_string_inside_kept_drafts_ends_the_output_there(engines):
    off, on = engines("llama", None), engines("llama", 5)
    free = off.generate(PROMPTS[:1], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    kept = on.stats()["spec_decode_num_accepted_tokens"]
    for start in (6, 14, 25):  # a few characters of the output's text, wherever they first occur
        stop = free.text[start:start + 3]
        params = SamplingParams(max_tokens=40, temperature=0.0, stop=[stop], ignore_eos=True, logprobs=1)
        want, got = off.generate(PROMPTS[:1], params)[0], on.generate(PROMPTS[:1], params)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop"), stop
        assert len(got.logprobs) == len(got.token_ids)
    assert on.stats()["spec_decode_num_accepted_tokens"] > kept
    assert_idle(on)


def test_with_async_scheduling_steps_run_in_order_while_requests_may_draft(engines):
    """Overlapped steps leave each sequence a token on the device, after which it cannot draft: an
    engine that overlaps steps runs them in order while requests may draft, and drafts."""
    off, on = engines("llama", None), engines("llama", 5).with_strategy("paged", async_scheduling=True)
    assert on.config.overlaps_steps
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert tokens_of(on, PROMPTS[:3], params) == tokens_of(off, PROMPTS[:3], params)
    assert on.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_idle(on)


def replay(prompt: list[int], output: list[int], k: int) -> tuple[int, int, int]:
    """(drafts, draft tokens, accepted) of one request decoding `output` alone, drafting with
    ngram_draft as the engine does (nothing paused): an independent count of the engine's."""
    drafts = tokens = kept = 0
    m = 1  # the first token comes from the prefill
    while m < len(output):
        guess = ngram_draft(prompt + output[:m], min(k, len(output) - m - 1), 1, 4)
        if guess:
            n = accepted(guess, output[m:])
            drafts, tokens, kept = drafts + 1, tokens + len(guess), kept + n
            m += n
        m += 1
    return drafts, tokens, kept


def test_the_counters_equal_a_replay_of_the_drafting(engines):
    off, on = engines("llama", None), engines("llama", 3)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)  # K = 3 on K = 5's runner would do too
    for prompt in PROMPTS:
        output = off.generate([prompt], params)[0].token_ids
        before = [on.stats()[name] for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                                "spec_decode_num_accepted_tokens")]
        assert on.generate([prompt], params)[0].token_ids == output
        after = [on.stats()[name] for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                               "spec_decode_num_accepted_tokens")]
        assert tuple(a - b for a, b in zip(after, before)) == replay(prompt, output, 3), prompt


def test_no_compile_after_warmup(engines):
    engine = engines("llama", 1)
    with pytest.raises(ValueError, match="2 speculative tokens need a new engine"):
        engine.with_strategy("paged", speculative={"num_speculative_tokens": 2})
    engine.warmup()
    compiles = engine.stats()["num_compiles"]
    params = [SamplingParams(max_tokens=30, temperature=t, seed=5, ignore_eos=True) for t in (0.0, 0.7, 0.0, 0.0, 0.7)]
    engine.generate(PROMPTS, params)
    assert engine.stats()["num_compiles"] == compiles and engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_idle(engine)


@pytest.fixture(scope="module")
def drafted(checkpoints):
    """An engine over a tiny Llama drafting with a draft model (K = 3), by the draft's kind:
    "llama" (the target's own checkpoint: its greedy drafts are the target's greedy tokens) or
    "qwen3" (other weights, the same vocabulary); and the same engine without speculation. A small
    pool (13 usable pages of 8 tokens), so that the requests below preempt each other."""
    built = {}

    def get(draft: str):
        if draft not in built:
            spec = {"method": "draft_model", "model": checkpoints(draft), "num_speculative_tokens": 3,
                    "min_acceptance": 0.0}
            on = Engine.from_pretrained(checkpoints("llama"), EngineConfig(
                **{**BASE, "num_pages": 14, "max_model_len": 96}, speculative=spec))
            built[draft] = on, on.with_strategy("paged", speculative=None)
        return built[draft]
    return get


def counts(engine) -> tuple[int, int]:
    stats = engine.stats()
    return stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]


@pytest.mark.parametrize("draft", ["llama", "qwen3"])
def test_a_draft_model_changes_no_token_greedy_or_sampled(drafted, draft):
    """With the target's own weights as the draft, every greedy draft is kept (exactly)."""
    on, off = drafted(draft)
    for temperature in (0.0, 0.8):
        params = [SamplingParams(max_tokens=20 + 4 * i, temperature=temperature, top_p=0.9, seed=i, ignore_eos=True)
                  for i in range(len(PROMPTS))]
        before = counts(on)
        assert tokens_of(on, PROMPTS, params) == tokens_of(off, PROMPTS, params), temperature
        drafted_tokens, kept = (a - b for a, b in zip(counts(on), before))
        assert drafted_tokens > 0
        if draft == "llama" and temperature == 0.0:
            assert kept == drafted_tokens
    assert_idle(on)


def test_warmup_compiles_the_draft_models_steps_too(drafted, monkeypatch):
    """(Each runner's warm-up compiling every program it runs is test_no_compile_after_warmup's.)"""
    on, _ = drafted("qwen3")
    warmed = []
    monkeypatch.setattr(on.runner, "warmup", lambda *args: warmed.append("target") or 0)
    monkeypatch.setattr(on.core.drafter.runner, "warmup", lambda *args: warmed.append("draft") or 0)
    on.warmup()
    assert sorted(warmed) == ["draft", "target"]


def test_a_draft_model_through_preemption_and_prefix_hits_changes_no_token(drafted):
    on, off = drafted("llama")
    shared = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]  # two full pages every prompt starts with
    prompts = [shared + p for p in PROMPTS]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    before, stats_before = counts(on), on.stats()
    assert tokens_of(on, prompts, params) == tokens_of(off, prompts, params)
    stats = on.stats()
    assert stats["num_preemptions"] > stats_before["num_preemptions"]
    assert stats["prefix_cache_hits"] > stats_before["prefix_cache_hits"]
    assert counts(on)[1] - before[1] == counts(on)[0] - before[0] > 0  # its own weights: every draft kept
    assert_idle(on)


def test_the_kv_budget_holds_both_pools(checkpoints):
    from jaxserve.model.config import ModelConfig
    from jaxserve.worker.kv_pool import page_bytes
    budget = 1 << 20
    spec = {"method": "draft_model", "model": checkpoints("qwen3")}
    engine = Engine.from_pretrained(checkpoints("llama"), EngineConfig(
        **{**BASE, "num_pages": None, "kv_cache_bytes": budget}, speculative=spec))
    configs = [ModelConfig.from_hf(json.load(open(f"{checkpoints(kind)}/config.json"))) for kind in ("llama", "qwen3")]
    per_page = sum(page_bytes(c, 8, "float32") for c in configs)
    assert engine.runner.config.num_pages == engine.core.drafter.runner.config.num_pages == budget // per_page
    assert "the draft model holding its own K/V in each" in engine.describe()


def test_a_draft_model_of_another_vocabulary_is_a_value_error(checkpoints, tmp_path):
    other = build_checkpoint(str(tmp_path / "other"), "llama", vocab_size=320)
    with pytest.raises(ValueError, match="a draft model must share the target's tokenizer"):
        Engine.from_pretrained(checkpoints("llama"), EngineConfig(**BASE, speculative={
            "method": "draft_model", "model": other}))
    with pytest.raises(ValueError, match="the draft_model method needs one"):
        EngineConfig(speculative={"method": "draft_model"})


def test_the_server_serves_the_tokens_and_exports_the_counters(engines):
    """Over HTTP (an in-thread engine loop, the real app): the completion's tokens are those of
    the engine without speculation, and /metrics and /v1/engine/state carry the counters."""
    import httpx
    from jaxserve.entrypoints.api_server import create_app
    from jaxserve.entrypoints.engine_client import EngineClient
    from server_helpers import ServerThread, response_validator, wait_idle
    off, on = engines("llama", None), engines("llama", 5)
    want = off.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].text
    client = EngineClient.in_thread(on)
    try:
        with ServerThread(create_app(client)) as server:
            body = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
            assert answer["choices"][0]["text"] == want and answer["usage"]["completion_tokens"] == 24
            m = wait_idle(server)
            stats = on.stats()
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                assert m[f"jaxserve_spec_decode_{name}_total"] == stats[f"spec_decode_{name}"] > 0, name
            state = httpx.get(server.url + "/v1/engine/state").json()
            response_validator(server, "/v1/engine/state").validate(state)
            assert state["stats"]["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_accepted_tokens"]
    finally:
        client.stop()
