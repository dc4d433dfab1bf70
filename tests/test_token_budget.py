"""The ragged step under a token budget, end to end on tiny Llama, Qwen3 and Gemma 3 checkpoints:
greedy tokens equal Hugging Face `generate` with budgets of 8, 16 and 64 tokens (prompts cut into
chunks of every size, chunk edges inside pages and on page edges), with chunked prefill off too;
no page leaks and no compile when a workload repeats."""

import numpy as np
import pytest
import torch
import transformers

from jaxserve import Engine, EngineConfig, SamplingParams

PAGE = 8
PROMPT_LENGTHS = [1, 5, 8, 9, 16, 17, 30, 45]
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
CONFIG = EngineConfig(max_slots=8, page_size=PAGE, num_pages=96, max_model_len=96, max_num_batched_tokens=64,
                      dtype="float32")


def prompts():
    rng = np.random.RandomState(7)
    return [rng.randint(3, 150, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def expected(checkpoints):
    """Hugging Face greedy continuations, one prompt at a time, per model kind."""
    cache = {}

    def get(kind):
        if kind not in cache:
            hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints(kind), dtype=torch.float32).eval()
            with torch.no_grad():
                cache[kind] = [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                           pad_token_id=0)[0, len(p):].tolist() for p in prompts()]
        return cache[kind]
    return get


@pytest.fixture(scope="module")
def engines(checkpoints):
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = Engine.from_pretrained(checkpoints(kind), CONFIG)
        return cache[kind]
    return get


def record_schedules(engine):
    """Wraps the scheduler so every step's {request: (start, tokens)} is kept."""
    log, schedule = [], engine.scheduler.schedule

    def recording():
        s = schedule()
        log.append({r.request_id: (r.num_computed_tokens, n) for r, n in s.num_tokens.items()})
        return s
    engine.scheduler.schedule = recording
    return log


def assert_idle(engine):
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == stats["used_pages"] == 0
    assert stats["free_pages"] + stats["cached_pages"] == stats["total_pages"]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("budget", [8, 16, 64])
def test_greedy_matches_hugging_face_under_a_token_budget(engines, expected, kind, budget):
    engine = engines(kind).with_strategy("paged", max_num_batched_tokens=budget)
    log = record_schedules(engine)
    outputs = engine.generate(prompts(), PARAMS)
    assert [o.token_ids for o in outputs] == expected(kind)
    assert all(sum(n for _, n in step.values()) <= budget for step in log)
    chunks = [(start, n) for step in log for start, n in step.values() if n > 1]
    if budget < max(PROMPT_LENGTHS):
        assert any(start > 0 for start, _ in chunks), "some prompt must run in several chunks"
    if budget < 64:  # decodes share the budget, so chunk edges fall both on and off page edges
        assert any(start % PAGE for start, _ in chunks) and any(start and start % PAGE == 0 for start, _ in chunks)
    assert_idle(engine)


def test_without_chunked_prefill_prompts_run_whole_with_the_same_tokens(checkpoints, expected):
    engine = Engine.from_pretrained(checkpoints("llama"), CONFIG.replace(enable_chunked_prefill=False,
                                                                           max_num_batched_tokens=16))
    log = record_schedules(engine)
    outputs = engine.generate(prompts(), PARAMS)
    assert [o.token_ids for o in outputs] == expected("llama")
    assert all(start == 0 for step in log for start, n in step.values() if n > 1)  # never chunked
    assert max(sum(n for _, n in step.values()) for step in log) > 16  # the step grew past the budget
    assert_idle(engine)


def test_a_repeated_workload_compiles_nothing(engines):
    engine = engines("llama").with_strategy("paged", max_num_batched_tokens=16)
    engine.generate(prompts(), PARAMS)
    before = engine.stats()["num_compiles"]
    engine.generate(prompts(), PARAMS)
    assert engine.stats()["num_compiles"] == before
    assert_idle(engine)


def test_a_budget_past_the_compiled_steps_is_refused(engines):
    with pytest.raises(ValueError, match="new engine"):
        engines("llama").with_strategy("paged", max_num_batched_tokens=128)
